"""make bench, part 3 (issue 29 item 4): what a checkpoint save costs the training, asynchronous
(--checkpoint-async on) against synchronous (off), on this machine.

Usage: python3 tests/bench/checkpoint.py --data TOKENS [--bin build/shardtrain] [--out build/bench]
           [--rounds 2] [--quick]

Model: a ~99M-parameter config (hidden 768, 12 layers, SwiGLU 2560, 12 heads, vocab 258, tied
embeddings; written to OUT/ckpt-100m-config.json): 1191.7 MB of parameters + AdamW moments per
checkpoint. 2 ranks (mpirun -np 2, Open MPI's default binding), --threads 1, seq-len 16, global
batch 2 (so that a step is about as long as a save), --steps 10, --checkpoint-every 3 (periodic
saves after steps 3, 6 and 9; the final save after step 10 is synchronous in both modes and waits
for the write in flight, so it is left out), --log-every 1, --eval-every 0 --eval-batches 1.
Runs are interleaved, off on / on off / ..., so that a change in the machine's load hits both alike,
each into a fresh checkpoint directory under OUT/ckpt-async/. After each run, before its checkpoints
are deleted, dd writes a new file of the checkpoint's size into the run's checkpoint directory:
dd if=/dev/zero bs=1M conv=fdatasync. So dd meets the page cache as the run's saves did (on the VM of
docs/benchmarks.md, writing into pages just freed is ~5x faster than into fresh ones, so a dd after
deleting files measures a state no save sees).

Measured, per periodic save, from the log:
* training blocked: off, "saved ... in T s ... (training blocked T s ...)"; on, "snapshot taken in
  S s, writing in the background (training blocked B s)";
* the write: its time and MB/s (the writer's own figures: off, "write W s"; on, "in the background:
  write W s, R MB/s"), against dd's MB/s of the same round;
* the steps that ran during a background write: on, "steps A-B ran meanwhile" (B, the step at whose
  boundary the end of the write was seen, may have overlapped it only in part).
Per step, from the metrics file (rank 0, --log-every 1): compute_ms + exposed_comm_ms, the step's
own time (train_step; a save's blocked time falls between two steps and is not in it). A normal
step: any step but the first of a run that does not overlap a background write (in off runs,
every step but the first). Writes OUT/ckpt-async.json and OUT/ckpt-async.md (the table of
docs/benchmarks.md: medians over saves and rounds). The targets of issue 29 (blocked time with
async <= 10% of the synchronous save's; steps during a write <= 1.25x a normal step; write
throughput >= 0.7x dd) are printed, not asserted.
--quick: a 10.4M-parameter model, 4 steps, 1 round: a smoke test of the harness, not a benchmark.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys

CONFIG = {"vocab_size": 258, "hidden_size": 768, "intermediate_size": 2560, "num_hidden_layers": 12,
          "num_attention_heads": 12, "max_position_embeddings": 64, "tie_word_embeddings": True,
          "bos_token_id": 256, "eos_token_id": 257}
QUICK_CONFIG = dict(CONFIG, hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8)

RE_BG_START = re.compile(r"checkpoint: step (\d+): snapshot taken in ([\d.]+) s, writing in the background "
                         r"\(training blocked ([\d.]+) s(?:, of which ([\d.]+) s waiting)?")
RE_BG_DONE = re.compile(r"checkpoint: saved '([^']*step_0*(\d+)\.h5)' \(([\d.]+) MB [^)]*\) in the background: "
                        r"write ([\d.]+) s, (\d+) MB/s(?:[^;]*; steps (\d+)-(\d+) ran meanwhile)?")
RE_SYNC = re.compile(r"checkpoint: saved '([^']*step_0*(\d+)\.h5)' \(([\d.]+) MB [^)]*\) in ([\d.]+) s, (\d+) MB/s "
                     r"\(training blocked ([\d.]+) s: snapshot ([\d.]+) s, write ([\d.]+) s")
RE_DD = re.compile(r"(\d+) bytes .* copied, ([\d.]+) s, ([\d.]+) ([kMG]?B)/s")


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def run(args, mode, rnd, cfg_path, steps, every):
    d = os.path.join(args.out, "ckpt-async", f"{mode}-r{rnd}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    metrics = os.path.join(d, "metrics.jsonl")
    cmd = ["mpirun", "-np", "2", args.bin, "--model", cfg_path, "--data", args.data, "--seq-len", "16",
           "--global-batch", "2", "--steps", str(steps), "--checkpoint-every", str(every), "--log-every", "1",
           "--eval-every", "0", "--eval-batches", "1", "--threads", "1", "--checkpoint-dir", os.path.join(d, "ck"),
           "--checkpoint-async", mode, "--metrics", metrics]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log = p.stdout + p.stderr
    with open(os.path.join(d, "log.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + log)
    if p.returncode != 0:
        sys.exit(f"checkpoint bench: {mode} round {rnd} failed (exit {p.returncode}); see {d}/log.txt")
    rows = [json.loads(l) for l in open(metrics)]
    step_ms = {r["step"]: r["compute_ms"] + r["exposed_comm_ms"] for r in rows if "loss" in r}
    saves, during = [], set()
    if mode == "on":
        starts = {int(m[1]): m for m in RE_BG_START.finditer(log)}
        for m in RE_BG_DONE.finditer(log):
            s = int(m[2])
            st = starts[s]
            meanwhile = list(range(int(m[6]), int(m[7]) + 1)) if m[6] else []
            during.update(meanwhile)
            saves.append({"step": s, "blocked_s": float(st[3]), "snapshot_s": float(st[2]),
                          "waited_s": float(st[4] or 0), "write_s": float(m[4]), "mb": float(m[3]),
                          "mb_s": float(m[3]) / float(m[4]), "steps_meanwhile": meanwhile})
    else:
        for m in RE_SYNC.finditer(log):
            saves.append({"step": int(m[2]), "blocked_s": float(m[6]), "snapshot_s": float(m[7]),
                          "write_s": float(m[8]), "mb": float(m[3]), "mb_s": float(m[3]) / float(m[8])})
    saves = [s for s in saves if s["step"] != steps]  # the final save: synchronous in both modes
    size = 0
    for f in os.listdir(os.path.join(d, "ck")):
        if f.endswith(".h5"):
            size = max(size, os.path.getsize(os.path.join(d, "ck", f)))
    # dd in the state the saves met: same directory, this run's checkpoints still there (their pages
    # dropped from the page cache by the save's POSIX_FADV_DONTNEED), a new file
    ddr = dd(os.path.join(d, "ck", "dd.bin"), size)
    shutil.rmtree(os.path.join(d, "ck"))  # 1.2 GB each
    first = min(step_ms)
    normal = [v for k, v in step_ms.items() if k != first and k not in during]
    dur = [step_ms[k] for k in sorted(during) if k in step_ms]
    banner = next((l for l in log.splitlines() if "OpenBLAS" in l), "")
    return {"mode": mode, "round": rnd, "saves": saves, "step_ms": step_ms, "during": sorted(during),
            "normal_ms": normal, "during_ms": dur, "file_bytes": size, "banner": banner, "dd": ddr}


def dd(path, nbytes):
    mib = max(1, round(nbytes / (1 << 20)))
    p = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fdatasync"],
                       capture_output=True, text=True)
    os.remove(path)
    m = RE_DD.search(p.stderr)
    if not m:
        sys.exit("checkpoint bench: cannot parse dd's output: " + p.stderr)
    return {"mib": mib, "bytes": int(m[1]), "s": float(m[2]), "mb_s": int(m[1]) / 1e6 / float(m[2])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/shardtrain")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="build/bench")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps, every, rounds, cfg = 10, 3, args.rounds, CONFIG
    if args.quick:
        steps, every, rounds, cfg = 4, 2, 1, QUICK_CONFIG
    os.makedirs(os.path.join(args.out, "ckpt-async"), exist_ok=True)
    cfg_path = os.path.join(args.out, "ckpt-100m-config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    runs, dds = [], []
    for rnd in range(1, rounds + 1):
        for mode in (("off", "on") if rnd % 2 else ("on", "off")):
            r = run(args, mode, rnd, cfg_path, steps, every)
            runs.append(r)
            for s in r["saves"]:
                extra = (f", snapshot {s['snapshot_s']:.2f} s, steps during the write {s['steps_meanwhile']}"
                         if mode == "on" else "")
                print(f"  round {rnd} {mode:3}: save of step {s['step']}: training blocked {s['blocked_s']:.2f} s, "
                      f"write {s['write_s']:.2f} s = {s['mb_s']:.0f} MB/s{extra}", flush=True)
            print(f"  round {rnd} {mode:3}: step ms, normal {['%.0f' % x for x in r['normal_ms']]}, during a write "
                  f"{['%.0f' % x for x in r['during_ms']]}", flush=True)
            dds.append(r["dd"])
            print(f"  round {rnd} {mode:3}: then dd {dds[-1]['mib']} MiB conv=fdatasync into the run's checkpoint "
                  f"directory: {dds[-1]['s']:.2f} s = {dds[-1]['mb_s']:.0f} MB/s", flush=True)

    def saves(mode, key):
        return [s[key] for r in runs if r["mode"] == mode for s in r["saves"]]

    def steps_of(mode, key):
        return [x for r in runs if r["mode"] == mode for x in r[key]]

    blk_off, blk_on = saves("off", "blocked_s"), saves("on", "blocked_s")
    mbs_off, mbs_on = saves("off", "mb_s"), saves("on", "mb_s")
    dd_mbs = [d["mb_s"] for d in dds]
    normal_on, normal_off, during = steps_of("on", "normal_ms"), steps_of("off", "normal_ms"), steps_of("on", "during_ms")
    normal = normal_on + normal_off
    res = {
        "date": datetime.date.today().isoformat(), "host": socket.gethostname(), "banner": runs[0]["banner"],
        "file_bytes": runs[0]["file_bytes"], "runs": runs, "dd": dds,
        "blocked_off_s": med(blk_off), "blocked_on_s": med(blk_on), "write_mb_s_off": med(mbs_off),
        "write_mb_s_on": med(mbs_on), "dd_mb_s": med(dd_mbs), "step_ms_normal": med(normal),
        "step_ms_normal_on": med(normal_on), "step_ms_normal_off": med(normal_off), "step_ms_during": med(during),
    }
    with open(os.path.join(args.out, "ckpt-async.json"), "w") as f:
        json.dump(res, f, indent=1)
    rng = lambda xs, fm="%.2f": (fm % min(xs) + " – " + fm % max(xs)) if xs else "-"
    md = [
        f"| per save (median; range) | `--checkpoint-async off` | `--checkpoint-async on` | ratio | target |",
        "|---|---|---|---|---|",
        f"| training blocked | {res['blocked_off_s']:.2f} s ({rng(blk_off)}) | {res['blocked_on_s']:.2f} s "
        f"({rng(blk_on)}) | on/off {res['blocked_on_s'] / res['blocked_off_s']:.2f} | ≤ 0.10 |",
        f"| write throughput (the writer's time) | {res['write_mb_s_off']:.0f} MB/s ({rng(mbs_off, '%.0f')}) | "
        f"{res['write_mb_s_on']:.0f} MB/s ({rng(mbs_on, '%.0f')}) | vs dd {res['dd_mb_s']:.0f} MB/s "
        f"({rng(dd_mbs, '%.0f')}): off {res['write_mb_s_off'] / res['dd_mb_s']:.2f}, on "
        f"{res['write_mb_s_on'] / res['dd_mb_s']:.2f} | ≥ 0.70 |",
        f"| step time, normal step | {res['step_ms_normal_off']:.0f} ms ({rng(normal_off, '%.0f')}, "
        f"{len(normal_off)} steps) | {res['step_ms_normal_on']:.0f} ms ({rng(normal_on, '%.0f')}, {len(normal_on)} "
        f"steps) | | |",
        f"| step time, during a background write | | {res['step_ms_during']:.0f} ms ({rng(during, '%.0f')}, "
        f"{len(during)} steps) | vs all normal steps ({res['step_ms_normal']:.0f} ms) "
        f"{res['step_ms_during'] / res['step_ms_normal']:.2f} | ≤ 1.25 |",
    ]
    with open(os.path.join(args.out, "ckpt-async.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"checkpoint bench: targets (not asserted): blocked on/off "
          f"{res['blocked_on_s'] / res['blocked_off_s']:.2f} (<= 0.10), steps during a write "
          f"{res['step_ms_during'] / res['step_ms_normal']:.2f}x (<= 1.25), write on / dd "
          f"{res['write_mb_s_on'] / res['dd_mb_s']:.2f} (>= 0.70)")


if __name__ == "__main__":
    main()
