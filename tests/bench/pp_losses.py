"""Loss check of the pipeline-parallel peer (issue 42): tests/bench/peer_torch_pp.py against shardtrain's
own run of the same job without pipelining, step by step.

Usage: python3 tests/bench/pp_losses.py --data build/data/fortunes.tok [--bin build/shardtrain]
           [--python .venv/bin/python] [--model tests/bench/demo-config.json] [--steps 20]
           [--runs 1f1b,gpipe,interleaved,fsdp] [--out build/bench/pp] [--tol 1e-4]

Runs shardtrain at 1 rank (--micro-batch as the peer's) once, then each run of --runs: 1f1b and gpipe
at 2 ranks (--pp 2), interleaved at 2 ranks x 2 chunks (--pp 2 --pp-virtual 2: 4 chunks, so the
model needs >= 4 layers), and fsdp: peer_torch.py at 1 rank (the control: the FSDP2 peer, no
micro-batches). Same config, data, seed, seq-len 64, global batch 12, micro-batch 3 (4 micro-batches),
warm-up 5, AdamW and clipping settings as throughput.py's COMMON. Prints per run the worst relative
loss difference over all steps, |peer - shardtrain| / |shardtrain|, and exits 1 when one exceeds
--tol or a run fails.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from throughput import COMMON, free_port  # noqa: E402

RUNS = {"1f1b": (2, ["--pp", "2", "--pp-schedule", "1f1b"]),
        "gpipe": (2, ["--pp", "2", "--pp-schedule", "gpipe"]),
        "interleaved": (2, ["--pp", "2", "--pp-schedule", "interleaved", "--pp-virtual", "2"]),
        "fsdp": (1, [])}


def losses(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, f)) if "loss" in r}


def run(cmd, log):
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--bin", default="build/shardtrain")
    p.add_argument("--python", default=".venv/bin/python")
    p.add_argument("--model", default=os.path.join(HERE, "demo-config.json"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=3)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--out", default="build/bench/pp")
    p.add_argument("--tol", type=float, default=1e-4)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tail = ["--model", a.model, "--data", a.data, "--seq-len", "64", "--global-batch", "12", "--steps", str(a.steps),
            "--warmup", "5", "--log-every", "1", "--threads", "1"] + COMMON
    mb = ["--micro-batch", str(a.micro_batch)]
    ref = os.path.join(a.out, "shardtrain.jsonl")
    cmd = ["mpirun", "--oversubscribe", "-np", "1", "--bind-to", "none", a.bin, "--eval-every", "0",
           "--eval-batches", "1", "--metrics", ref] + tail + mb
    if run(cmd, ref[:-6] + ".log"):
        sys.exit(f"pp_losses: shardtrain failed, see {ref[:-6]}.log")
    want, bad = losses(ref), False
    for name in [x for x in a.runs.split(",") if x]:
        np_, extra = RUNS[name]
        met = os.path.join(a.out, f"{name}.jsonl")
        script = "peer_torch.py" if name == "fsdp" else "peer_torch_pp.py"
        cmd = (["mpirun", "--oversubscribe", "-np", str(np_)] + (["--bind-to", "none"] if np_ == 1 else [])
               + [a.python, os.path.join(HERE, script), "--port", str(free_port()), "--metrics", met] + tail
               + ([] if name == "fsdp" else mb) + extra)
        if run(cmd, met[:-6] + ".log"):
            print(f"{name:12} FAILED, see {met[:-6]}.log")
            bad = True
            continue
        got = losses(met)
        if sorted(got) != sorted(want):
            print(f"{name:12} logged steps {sorted(got)} differ from shardtrain's {sorted(want)}")
            bad = True
            continue
        worst = max((abs(got[s] - want[s]) / abs(want[s]), s) for s in want)
        ok = worst[0] <= a.tol
        bad = bad or not ok
        print(f"{name:12} {len(want)} steps: worst relative loss difference {worst[0]:.2e} (step {worst[1]}: "
              f"{got[worst[1]]:.6f} vs shardtrain {want[worst[1]]:.6f}), final {got[max(got)]:.6f} vs "
              f"{want[max(want)]:.6f} {'ok' if ok else 'ABOVE ' + str(a.tol)}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
