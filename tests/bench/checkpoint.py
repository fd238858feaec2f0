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
are deleted, dd writes new files of the checkpoint's size into the run's checkpoint directory
(dd if=/dev/zero bs=1M conv=fdatasync), three times: right after the run; after a pause of one save
interval; and a second file beside that one. On a VM with free page reporting (docs/benchmarks.md,
"Checkpoint writes past the page cache") a buffered write's speed depends on how long ago the pages
it gets were freed, so the three measure the states a save can meet: the most favourable, a run's
later saves', a run's first save's. The table compares each kind of save with dd in its state.

Measured, per periodic save, from the log:
* training blocked: off, "saved ... in T s ... (training blocked T s ...)"; on, "snapshot taken in
  S s, writing in the background (training blocked B s)" plus, on the CPU, the next update's wait
  for the writer thread's copy ("training blocked W s waiting for it" in the line of the finished write);
* the write: its time and MB/s (the writer's own figures: off, "write W s"; on, "in the background:
  write W s, R MB/s"), against dd's MB/s of the same run;
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
import time

CONFIG = {"vocab_size": 258, "hidden_size": 768, "intermediate_size": 2560, "num_hidden_layers": 12,
          "num_attention_heads": 12, "max_position_embeddings": 64, "tie_word_embeddings": True,
          "bos_token_id": 256, "eos_token_id": 257}
QUICK_CONFIG = dict(CONFIG, hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8)

RE_BG_START = re.compile(r"checkpoint: step (\d+): snapshot taken in ([\d.]+) s, writing in the background "
                         r"\(training blocked ([\d.]+) s(?:, of which ([\d.]+) s waiting)?")
RE_BG_DONE = re.compile(r"checkpoint: saved '([^']*step_0*(\d+)(?:\.h5)?)' \(([\d.]+) MB [^)]*\) in the background: "
                        r"write ([\d.]+) s, (\d+) MB/s(?:[^;\n]*; steps (\d+)-(\d+) ran meanwhile)?[^\n]*")
RE_COPY_WAIT = re.compile(r"training blocked ([\d.]+) s waiting for it")
RE_SYNC = re.compile(r"checkpoint: saved '([^']*step_0*(\d+)(?:\.h5)?)' \(([\d.]+) MB [^)]*\) in ([\d.]+) s, (\d+) MB/s "
                     r"\(training blocked ([\d.]+) s: snapshot ([\d.]+) s, write ([\d.]+) s")
RE_DD = re.compile(r"(\d+) bytes .* copied, ([\d.]+) s, ([\d.]+) ([kMG]?B)/s")


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def run(args, mode, rnd, cfg_path, steps, every):
    d = os.path.join(args.out, "ckpt-async", f"{mode}-r{rnd}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    metrics = os.path.join(d, "metrics.jsonl")
    torch = mode.startswith("torch-")
    prog = [args.python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_torch.py"),
            "--port", str(29600 + rnd * 10 + len(mode))] if torch else [args.bin]
    cmd = ["mpirun", "-np", str(args.np)] + prog + [
           "--model", cfg_path, "--data", args.data, "--seq-len", "16",
           "--global-batch", "2", "--steps", str(steps), "--checkpoint-every", str(every), "--log-every", "1",
           "--eval-every", "0", "--eval-batches", "1", "--threads", "1", "--checkpoint-dir", os.path.join(d, "ck"),
           "--checkpoint-async", mode.removeprefix("torch-"), "--metrics", metrics]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log = p.stdout + p.stderr
    with open(os.path.join(d, "log.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + log)
    if p.returncode != 0:
        sys.exit(f"checkpoint bench: {mode} round {rnd} failed (exit {p.returncode}); see {d}/log.txt")
    rows = [json.loads(l) for l in open(metrics)]
    # the step's own time: shardtrain's compute + exposed communication; the peer's, from tokens/s of a
    # one-step log interval (its step time, measured before the save as shardtrain's is)
    step_ms = {r["step"]: (r["compute_ms"] + r["exposed_comm_ms"]) if "compute_ms" in r else 2 * 16 * 1e3 / r["tokens_per_s"]
               for r in rows if "loss" in r}
    saves, during = [], set()
    if mode.endswith("on"):
        starts = {int(m[1]): m for m in RE_BG_START.finditer(log)}
        for m in RE_BG_DONE.finditer(log):
            s = int(m[2])
            st = starts[s]
            meanwhile = list(range(int(m[6]), int(m[7]) + 1)) if m[6] else []
            during.update(meanwhile)
            # the writer thread's copy of the shards (CPU): the update after the save may wait for it
            cw = RE_COPY_WAIT.search(m[0])
            copy_wait = float(cw[1]) if cw else 0.0
            saves.append({"step": s, "blocked_s": float(st[3]) + copy_wait, "snapshot_s": float(st[2]),
                          "copy_wait_s": copy_wait,
                          "waited_s": float(st[4] or 0), "write_s": float(m[4]), "mb": float(m[3]),
                          "mb_s": float(m[3]) / float(m[4]), "steps_meanwhile": meanwhile})
    else:
        for m in RE_SYNC.finditer(log):
            saves.append({"step": int(m[2]), "blocked_s": float(m[6]), "snapshot_s": float(m[7]),
                          "write_s": float(m[8]), "mb": float(m[3]), "mb_s": float(m[3]) / float(m[8])})
    saves = [s for s in saves if s["step"] != steps]  # the final save: synchronous in both modes
    size = 0  # one checkpoint's bytes: shardtrain's largest .h5 file, or the peer's largest step_N directory
    for f in os.listdir(os.path.join(d, "ck")):
        fp = os.path.join(d, "ck", f)
        if f.endswith(".h5"):
            size = max(size, os.path.getsize(fp))
        elif torch and f.startswith("step_") and os.path.isdir(fp):
            size = max(size, sum(os.path.getsize(os.path.join(fp, x)) for x in os.listdir(fp)))
    # dd in the states the saves met, same directory, this run's checkpoints still there. On a VM with
    # free page reporting (virtio-balloon; the firecracker guest of docs/benchmarks.md) memory the guest
    # frees goes back to the host within seconds, and the next write into it faults in the host: a
    # write is ~5x faster into pages freed a moment ago than into pages freed 8 s ago, for any writer.
    # So dd three times: (1) right after the run, into the pages the final save just dropped from the
    # page cache (POSIX_FADV_DONTNEED): the most favourable state, the only one measured before; (2)
    # after a pause as long as the interval between two saves (every x a normal step), the state a
    # save after a run's first met; (3) with that file kept, a second file, which gets pages the guest
    # had not used lately: the state of a run's first save.
    normal_now = [v for k, v in step_ms.items() if k != min(step_ms)]
    pause = every * statistics.median(normal_now) / 1e3 if normal_now else 0.0
    ddr = dd(os.path.join(d, "ck", "dd.bin"), size)
    time.sleep(pause)
    ddi = dd(os.path.join(d, "ck", "dd-interval.bin"), size, keep=True)
    ddi["pause_s"] = pause
    ddf = dd(os.path.join(d, "ck", "dd-fresh.bin"), size)
    os.remove(os.path.join(d, "ck", "dd-interval.bin"))
    if saves:
        first_save = min(s["step"] for s in saves)
        for s in saves:
            s["first"] = s["step"] == first_save
    shutil.rmtree(os.path.join(d, "ck"))  # 1.2 GB each
    first = min(step_ms)
    normal = [v for k, v in step_ms.items() if k != first and k not in during]
    dur = [step_ms[k] for k in sorted(during) if k in step_ms]
    banner = next((l for l in log.splitlines() if "OpenBLAS" in l), "")
    return {"mode": mode, "round": rnd, "saves": saves, "step_ms": step_ms, "during": sorted(during),
            "normal_ms": normal, "during_ms": dur, "file_bytes": size, "banner": banner, "dd": ddr, "dd_interval": ddi, "dd_fresh": ddf}


def dd(path, nbytes, keep=False):
    mib = max(1, round(nbytes / (1 << 20)))
    p = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fdatasync"],
                       capture_output=True, text=True)
    if not keep:
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
    ap.add_argument("--python", default=".venv/bin/python", help="the venv's python, for the PyTorch DCP peer")
    ap.add_argument("--no-peer", action="store_true", help="leave out the PyTorch DCP peer runs")
    ap.add_argument("--np", type=int, default=2, help="world size (2: the issue's W = 2; 1: one rank, whose "
                    "writer thread has the other core of a 2-core machine to itself)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps, every, rounds, cfg = 10, 3, args.rounds, CONFIG
    if args.quick:
        steps, every, rounds, cfg = 4, 2, 1, QUICK_CONFIG
    os.makedirs(os.path.join(args.out, "ckpt-async"), exist_ok=True)
    cfg_path = os.path.join(args.out, "ckpt-100m-config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    modes = ["off", "on"] + ([] if args.no_peer else ["torch-off", "torch-on"])
    runs = []
    for rnd in range(1, rounds + 1):
        for mode in (modes if rnd % 2 else modes[::-1]):
            r = run(args, mode, rnd, cfg_path, steps, every)
            runs.append(r)
            for s in r["saves"]:
                extra = (f", snapshot {s['snapshot_s']:.2f} s, steps during the write {s['steps_meanwhile']}"
                         if mode.endswith("on") else "")
                print(f"  round {rnd} {mode:9}: save of step {s['step']}: training blocked {s['blocked_s']:.2f} s, "
                      f"write {s['write_s']:.2f} s = {s['mb_s']:.0f} MB/s{extra}", flush=True)
            print(f"  round {rnd} {mode:9}: step ms, normal {['%.0f' % x for x in r['normal_ms']]}, during a write "
                  f"{['%.0f' % x for x in r['during_ms']]}", flush=True)
            print(f"  round {rnd} {mode:9}: then dd {r['dd']['mib']} MiB conv=fdatasync into the run's checkpoint "
                  f"directory: {r['dd']['s']:.2f} s = {r['dd']['mb_s']:.0f} MB/s; after {r['dd_interval']['pause_s']:.1f} s "
                  f"(a save interval): {r['dd_interval']['mb_s']:.0f} MB/s; a second file beside it (fresh pages): "
                  f"{r['dd_fresh']['mb_s']:.0f} MB/s", flush=True)

    def of(prog):  # the figures of one program ("" shardtrain, "torch-" the peer)
        def saves(mode, key, first=None):  # first: None every save, True / False a run's first save / the others
            return [s[key] for r in runs if r["mode"] == prog + mode for s in r["saves"]
                    if first is None or s.get("first") == first]

        def steps_of(mode, key):
            return [x for r in runs if r["mode"] == prog + mode for x in r[key]]
        f = {"blk_off": saves("off", "blocked_s"), "blk_on": saves("on", "blocked_s"),
             "mbs_off": saves("off", "mb_s"), "mbs_on": saves("on", "mb_s"),
             "mbs_off_first": saves("off", "mb_s", True), "mbs_off_later": saves("off", "mb_s", False),
             "mbs_on_first": saves("on", "mb_s", True), "mbs_on_later": saves("on", "mb_s", False),
             "dd": [r["dd"]["mb_s"] for r in runs if r["mode"] in (prog + "off", prog + "on")],
             "dd_fresh": [r["dd_fresh"]["mb_s"] for r in runs if r["mode"] in (prog + "off", prog + "on")],
             "dd_interval": [r["dd_interval"]["mb_s"] for r in runs if r["mode"] in (prog + "off", prog + "on")],
             "normal_on": steps_of("on", "normal_ms"), "normal_off": steps_of("off", "normal_ms"),
             "during": steps_of("on", "during_ms")}
        f["normal"] = f["normal_on"] + f["normal_off"]
        f.update({k + "_med": med(v) for k, v in list(f.items())})
        # training time a save costs: sync, its blocked time; async, its blocked time plus what the steps
        # that ran during its write took beyond a normal step (summed over the steps, per save)
        n_on = len(saves("on", "blocked_s"))
        f["lost_on"] = (f["blk_on_med"] + (sum(f["during"]) - len(f["during"]) * f["normal_med"]) / 1e3 / n_on
                        if n_on else float("nan"))
        return f
    progs = {"shardtrain": of("")}
    if not args.no_peer:
        progs["PyTorch DCP"] = of("torch-")
    res = {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "banner": runs[0]["banner"],
           "file_bytes": runs[0]["file_bytes"], "runs": runs, "summary": progs}
    with open(os.path.join(args.out, "ckpt-async.json"), "w") as f:
        json.dump(res, f, indent=1)
    rng = lambda xs, fm="%.2f": (fm % min(xs) + " – " + fm % max(xs)) if xs else "-"
    md = ["| per save (median; range) | program | sync (`off` / `dcp.save`) | async (`on` / `dcp.async_save`) "
          "| ratio | target |", "|---|---|---|---|---|---|"]
    for name, f in progs.items():
        md += [
            f"| training blocked | {name} | {f['blk_off_med']:.2f} s ({rng(f['blk_off'])}) | {f['blk_on_med']:.2f} s "
            f"({rng(f['blk_on'])}) | async/sync {f['blk_on_med'] / f['blk_off_med']:.2f} | ≤ 0.10 |",
            f"| write throughput (the writer's time) | {name} | {f['mbs_off_med']:.0f} MB/s ({rng(f['mbs_off'], '%.0f')}) | "
            f"{f['mbs_on_med']:.0f} MB/s ({rng(f['mbs_on'], '%.0f')}) | vs dd right after the same runs {f['dd_med']:.0f} MB/s "
            f"({rng(f['dd'], '%.0f')}): sync {f['mbs_off_med'] / f['dd_med']:.2f}, async "
            f"{f['mbs_on_med'] / f['dd_med']:.2f} | ≥ 0.70 |",
            f"| write throughput, saves after a run's first (recycled pages) | {name} | {f['mbs_off_later_med']:.0f} MB/s "
            f"({rng(f['mbs_off_later'], '%.0f')}) | {f['mbs_on_later_med']:.0f} MB/s ({rng(f['mbs_on_later'], '%.0f')}) | "
            f"vs dd in that state (a save interval after a drop) {f['dd_interval_med']:.0f} MB/s "
            f"({rng(f['dd_interval'], '%.0f')}): sync {f['mbs_off_later_med'] / f['dd_interval_med']:.2f}, async "
            f"{f['mbs_on_later_med'] / f['dd_interval_med']:.2f} | ≥ 0.70 |",
            f"| write throughput, a run's first save (fresh pages) | {name} | {f['mbs_off_first_med']:.0f} MB/s "
            f"({rng(f['mbs_off_first'], '%.0f')}) | {f['mbs_on_first_med']:.0f} MB/s ({rng(f['mbs_on_first'], '%.0f')}) | "
            f"vs dd in that state {f['dd_fresh_med']:.0f} MB/s ({rng(f['dd_fresh'], '%.0f')}): sync "
            f"{f['mbs_off_first_med'] / f['dd_fresh_med']:.2f}, async {f['mbs_on_first_med'] / f['dd_fresh_med']:.2f} "
            f"| ≥ 0.70 |",
            f"| step time, normal step | {name} | {f['normal_off_med']:.0f} ms ({rng(f['normal_off'], '%.0f')}, "
            f"{len(f['normal_off'])} steps) | {f['normal_on_med']:.0f} ms ({rng(f['normal_on'], '%.0f')}, "
            f"{len(f['normal_on'])} steps) | | |",
            f"| step time, during a background write | {name} | | {f['during_med']:.0f} ms ({rng(f['during'], '%.0f')}, "
            f"{len(f['during'])} steps) | vs all normal steps ({f['normal_med']:.0f} ms) "
            f"{f['during_med'] / f['normal_med']:.2f} | ≤ 1.25 |",
            f"| training time lost per save (blocked + the slower steps' excess) | {name} | {f['blk_off_med']:.2f} s | "
            f"{f['lost_on']:.2f} s | async/sync {f['lost_on'] / f['blk_off_med']:.2f} | |"]
    with open(os.path.join(args.out, "ckpt-async.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    for name, f in progs.items():
        print(f"checkpoint bench: {name}: targets (not asserted): blocked async/sync "
              f"{f['blk_on_med'] / f['blk_off_med']:.2f} (<= 0.10), steps during a write "
              f"{f['during_med'] / f['normal_med']:.2f}x (<= 1.25), write sync / dd {f['mbs_off_med'] / f['dd_med']:.2f}, "
              f"async / dd {f['mbs_on_med'] / f['dd_med']:.2f} (>= 0.70); against dd in the same page-cache state: "
              f"later saves sync {f['mbs_off_later_med'] / f['dd_interval_med']:.2f}, async "
              f"{f['mbs_on_later_med'] / f['dd_interval_med']:.2f}; "
              f"first saves sync {f['mbs_off_first_med'] / f['dd_fresh_med']:.2f}, async "
              f"{f['mbs_on_first_med'] / f['dd_fresh_med']:.2f}")


if __name__ == "__main__":
    main()
