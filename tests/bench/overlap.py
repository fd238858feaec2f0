"""make bench, part 6 (issue 15): how much communication overlap hides, on this machine.

Usage: python3 tests/bench/overlap.py --data TOKENS [--bin build/shardtrain] [--out build/bench]
           [--rounds 2] [--worlds 2,4] [--modes off,thread,poll,wait] [--quick]

Model: tests/bench/scaling-config.json (hidden 1024, 4 layers, SwiGLU 2816, 16 / 4 heads, vocab
258: 45M parameters, 180 MB in fp32, so each step all-gathers every unit twice and
reduce-scatters it once: about 0.5 GB per rank per step), seq-len 128, micro-batch 1, global
batch W (one micro-batch per rank per step), fp32, --threads 1, mpirun --oversubscribe
--bind-to none. Modes:
  off     --overlap off: every collective is waited for when it is started (the reference)
  thread  --overlap on --comm-progress thread (a communication thread tests the requests)
  poll    --overlap on --comm-progress poll (MPI_Test between GEMM tiles)
  wait    --overlap on --comm-progress wait (the requests progress only inside MPI_Wait)
  ucx-off, ucx-poll, ucx-tcp-off   Open MPI's UCX PML (the job scripts' choice under srun) against
          ob1: off, the default overlap (poll), and TCP alone; compared with off, poll and tcp-off
  tcp-off, tcp-async   Open MPI 4.1's own asynchronous progress exists only in its TCP transport
          (btl_tcp_progress_thread): --overlap off, and on with wait progress plus that thread,
          both over loopback TCP (OMPI_MCA_btl=self,tcp) instead of shared memory
all with --prefetch 1. Runs are interleaved, A B C D A B C D, world size by world size, so that
a change in the machine's load hits every mode alike.

Measured per run, from the metrics file (rank 0; per-step means over each --log-every interval,
src/train/trainer_report.cpp), over the steps after the first WARMUP:
* tokens/s; exposed_comm_ms (time rank 0 waited in a collective); comm_ms (from the start of
  each collective to its completion); compute_ms (the rest of the step);
* CPU seconds of the whole run, all ranks (getrusage(RUSAGE_CHILDREN) around mpirun), per step;
* the losses: every mode must print the same losses as off (overlap changes no arithmetic),
  and a run that does not is reported as a failure.
Writes build/bench/overlap.json and build/bench/overlap.md (the table of docs/benchmarks.md,
with the medians over rounds and each ratio against off of the same round). The target of
issue 15 (exposed communication at W = 4 at most half of off's) is printed, not asserted.
--quick: a few steps, a smoke test of the harness, not a benchmark.
"""
import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# mode: (shardtrain options, environment). The tcp-* pair measures Open MPI 4.1's own asynchronous
# progress, which only its TCP transport has (btl_tcp_progress_thread; shared memory has none):
# tcp-async against tcp-off, both over loopback TCP instead of shared memory.
TCP = {"OMPI_MCA_btl": "self,tcp"}
UCX = {"OMPI_MCA_pml": "ucx", "OMPI_MCA_pml_ucx_tls": "any", "OMPI_MCA_pml_ucx_devices": "any"}
MODES = {
    "off": (["--overlap", "off"], {}),
    "thread": (["--overlap", "on", "--comm-progress", "thread"], {}),
    "poll": (["--overlap", "on", "--comm-progress", "poll"], {}),
    "wait": (["--overlap", "on", "--comm-progress", "wait"], {}),
    "tcp-off": (["--overlap", "off"], TCP),
    "tcp-async": (["--overlap", "on", "--comm-progress", "wait"], dict(TCP, OMPI_MCA_btl_tcp_progress_thread="1")),
    # Open MPI's UCX PML, as the job scripts select it under srun (jobs/job-common.sh, st_srun_pml;
    # docs/slurm-startup-crash.md), against ob1: with overlap off, with the default overlap (poll),
    # and over TCP alone (UCX_TLS=tcp,self, against ob1's tcp-off).
    "ucx-off": (["--overlap", "off"], UCX),
    "ucx-poll": (["--overlap", "on", "--comm-progress", "poll"], UCX),
    "ucx-tcp-off": (["--overlap", "off"], dict(UCX, UCX_TLS="tcp,self", UCX_NET_DEVICES="lo")),
}


def baseline(mode):
    if mode == "ucx-poll":
        return "poll"
    return "tcp-off" if "tcp-" in mode else "off"


def run_one(a, W, mode, rnd):
    tag = f"overlap-w{W}-{mode}-r{rnd}"
    metrics = os.path.join(a.out, tag + ".jsonl")
    log = os.path.join(a.out, tag + ".log")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(W), a.bin,
           "--model", os.path.join(HERE, "scaling-config.json"), "--data", a.data, "--seq-len", "128",
           "--micro-batch", "1", "--global-batch", str(W), "--steps", str(a.steps), "--precision", "fp32",
           "--threads", "1", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--seed", "7",
           "--prefetch", str(a.prefetch), "--metrics", metrics] + MODES[mode][0]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, **MODES[mode][1]))
    wall = time.time() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if p.returncode != 0:
        sys.exit(f"overlap.py: {tag} failed (exit {p.returncode}); see {log}")
    rows = [json.loads(l) for l in open(metrics) if l.strip()]
    tr = [r for r in rows if "loss" in r]
    win = [r for r in tr if r["step"] > a.warmup]
    mean = lambda k: statistics.fmean(r[k] for r in win)
    return dict(world=W, mode=mode, round=rnd, wall_s=wall, cpu_s=cpu, cpu_s_per_step=cpu / a.steps,
                tokens_per_s=mean("tokens_per_s"), exposed_ms=mean("exposed_comm_ms"), comm_ms=mean("comm_ms"),
                compute_ms=mean("compute_ms"), losses=[r["loss"] for r in tr])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "shardtrain"))
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--modes", default="off,thread,poll,wait,tcp-off,tcp-async")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefetch", type=int, default=1, help="--prefetch of the overlap modes")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the means")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup, a.rounds = 3, 1, 1
    os.makedirs(a.out, exist_ok=True)
    worlds = [int(w) for w in a.worlds.split(",")]
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            sys.exit(f"overlap.py: unknown mode '{m}' (--modes takes {','.join(MODES)})")
    runs = []
    for rnd in range(1, a.rounds + 1):
        for W in worlds:
            for m in modes:
                r = run_one(a, W, m, rnd)
                runs.append(r)
                print(f"round {rnd} W={W} {m:6s}: {r['tokens_per_s']:8.1f} tok/s, exposed {r['exposed_ms']:7.1f} ms/step, "
                      f"comm {r['comm_ms']:7.1f}, compute {r['compute_ms']:7.1f}, CPU {r['cpu_s_per_step']:.2f} s/step, "
                      f"wall {r['wall_s']:.1f} s", flush=True)

    failures = []
    for W in worlds:  # overlap changes no arithmetic: every mode's losses equal off's, bitwise
        ref = [r for r in runs if r["world"] == W and r["mode"] == modes[0]][0]["losses"]
        for r in runs:
            if r["world"] == W and r["losses"] != ref:
                failures.append(f"W={W} {r['mode']} round {r['round']}: losses differ from {modes[0]}'s")

    def ratios(W, m, key):  # per round, against the baseline mode of the same round
        out = []
        base = baseline(m) if baseline(m) in modes else modes[0]
        for rnd in range(1, a.rounds + 1):
            x = [r for r in runs if r["world"] == W and r["mode"] == m and r["round"] == rnd][0][key]
            b = [r for r in runs if r["world"] == W and r["mode"] == base and r["round"] == rnd][0][key]
            out.append(x / b if b > 0 else float("nan"))
        return out

    lines = []
    host = socket.gethostname()
    cpu_model = ""
    try:
        cpu_model = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
    except (OSError, IndexError):
        pass
    lines.append(f"Machine: {cpu_model}, {os.cpu_count()} cores ({host}); {datetime.date.today().isoformat()}; "
                 f"{a.rounds} round(s) interleaved ({', '.join(modes)}), prefetch {a.prefetch}, {a.steps} steps, means over steps "
                 f"{a.warmup + 1}-{a.steps}, medians over rounds; ratio columns: per round against "
                 f"`off` of the same round (`tcp-off` for the tcp modes, `poll` for ucx-poll), min-max.")
    lines.append("")
    lines.append("| W | mode | tokens/s | exposed comm ms/step | comm issued ms/step | compute ms/step | CPU s/step (all ranks) | tokens/s vs baseline | exposed vs baseline |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    med = lambda W, m, k: statistics.median(r[k] for r in runs if r["world"] == W and r["mode"] == m)
    rng = lambda v: f"{min(v):.2f}-{max(v):.2f}" if len(v) > 1 else f"{v[0]:.2f}"
    for W in worlds:
        for m in modes:
            lines.append(f"| {W} | {m} | {med(W, m, 'tokens_per_s'):.1f} | {med(W, m, 'exposed_ms'):.1f} | "
                         f"{med(W, m, 'comm_ms'):.1f} | {med(W, m, 'compute_ms'):.1f} | {med(W, m, 'cpu_s_per_step'):.2f} | "
                         f"{rng(ratios(W, m, 'tokens_per_s'))} | {rng(ratios(W, m, 'exposed_ms'))} |")
    lines.append("")
    if 4 in worlds and "off" in modes:
        for m in modes:
            if m in ("off", "tcp-off"):
                continue
            v = ratios(4, m, "exposed_ms")
            ok = max(v) <= 0.5
            lines.append(f"- issue 15 target at W = 4, {m}: exposed communication at most half of {baseline(m)}'s: "
                         f"{'met' if ok else 'NOT met'} (ratio {rng(v)})")
    lines.append(f"- losses identical to `{modes[0]}` in every run: {'yes' if not failures else 'NO: ' + '; '.join(failures)}")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "overlap.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "overlap.json"), "w") as f:
        json.dump(runs, f, indent=1)
    print(md)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
