#!/usr/bin/env python3
"""Plots shardtrain metrics files (`--metrics`, JSON lines written by rank 0) into one PNG: train and
validation loss, learning rate, gradient norm and tokens/s against the step, one line per file.

    .venv/bin/python scripts/plot_metrics.py build/demo-metrics.jsonl --out build/demo-loss.png
    .venv/bin/python scripts/plot_metrics.py runA.jsonl runB.jsonl --out compare.png

Rows used: {"step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"} every --log-every steps
(src/train/trainer_report.cpp), and {"step", "val_loss"} at each evaluation (src/train/trainer.cpp).
A resumed run appends to the same file; a step written twice keeps its last row.
"""

import argparse
import json
import math
import os
import sys


class Fail(Exception):
    pass


def read_metrics(path):
    """-> {"train": {step: row}, "val": {step: val_loss}, "skipped": n}; raises Fail naming the file."""
    if not os.path.exists(path):
        raise Fail(f"metrics file '{path}': no such file")
    if os.path.isdir(path):
        raise Fail(f"metrics file '{path}' is a directory")
    train, val, skipped = {}, {}, 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                step = int(r["step"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                skipped += 1  # e.g. the half-written last line of a killed run
                continue
            if "val_loss" in r:
                val[step] = float(r["val_loss"])
            elif "loss" in r:
                train[step] = r
            else:
                skipped += 1
    if not train and not val:
        raise Fail(f"metrics file '{path}': no usable records (expected JSON lines with \"step\" and "
                   f"\"loss\" or \"val_loss\"{'; ' + str(skipped) + ' unreadable line(s)' if skipped else ''})")
    return {"train": train, "val": val, "skipped": skipped}


def series(rows, key):
    pts = [(s, float(r[key])) for s, r in sorted(rows.items()) if r.get(key) is not None]
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts]


def plot(runs, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), dpi=100, sharex=True)
    (ax_loss, ax_lr), (ax_gn, ax_tps) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, m) in enumerate(runs):
        c = colors[i % len(colors)]
        x, y = series(m["train"], "loss")
        if x:
            ax_loss.plot(x, y, color=c, lw=1.5, label=f"{name} train")
        if m["val"]:
            vs = sorted(m["val"].items())
            ax_loss.plot([s for s, _ in vs], [v for _, v in vs], color=c, lw=1.5, ls="--", marker="o", ms=4,
                         label=f"{name} val")
        for ax, key in ((ax_lr, "lr"), (ax_gn, "grad_norm"), (ax_tps, "tokens_per_s")):
            x, y = series(m["train"], key)
            if x:
                ax.plot(x, y, color=c, lw=1.5, label=name)
    ax_loss.set_title("loss (solid: train, dashed: validation)")
    ax_loss.set_ylabel("cross-entropy (nats/token)")
    ax_lr.set_title("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax_gn.set_title("gradient norm (before clipping)")
    ax_tps.set_title("throughput")
    ax_tps.set_ylabel("tokens/s")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, loc="best")
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="metrics files (JSON lines, shardtrain --metrics)")
    p.add_argument("--out", default="loss.png", help="PNG to write (default: loss.png)")
    p.add_argument("--title", help="figure title (default: the file names)")
    a = p.parse_args(argv)
    try:
        if os.path.isdir(a.out):
            raise Fail(f"output '{a.out}' is a directory")
        runs = []
        for path in a.metrics:
            m = read_metrics(path)
            runs.append((os.path.basename(path), m))
        plot(runs, a.out, a.title or ", ".join(n for n, _ in runs))
    except Fail as e:
        print(f"plot_metrics: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"plot_metrics: error: cannot write '{a.out}': {e.strerror or e}", file=sys.stderr)
        return 1
    for name, m in runs:
        t, v = m["train"], m["val"]
        last = f"train loss {t[max(t)]['loss']:.4f} at step {max(t)}" if t else "no train rows"
        lastv = f", val loss {v[max(v)]:.4f} at step {max(v)}" if v else ""
        skip = f" ({m['skipped']} unreadable line(s) skipped)" if m["skipped"] else ""
        print(f"{name}: {len(t)} train rows, {len(v)} eval rows; {last}{lastv}{skip}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
