"""make bench, part 2: shardtrain against its PyTorch peer (tests/bench/peer_torch.py), interleaved.

Usage: python3 tests/bench/throughput.py --data TOKENS [--bin build/shardtrain]
           [--python .venv/bin/python] [--out build/bench] [--rounds 2] [--cases a,b] [--quick]
           [--baseline OTHER_SHARDTRAIN] [--blas-env inherit|cpu]
           [--programs shardtrain,baseline,torch-eager,torch-compile,torch-tp,shardtrain-ref]

Cases (issue 12): the same model config.json, token file, global batch, schedule, AdamW settings
and seed for both programs; CPU fp32.
  demo-2x1  tests/bench/demo-config.json (shardtrain's `demo` preset), seq-len 64, 2 ranks x 1 thread
  demo-1x2  the same, 1 rank x 2 threads (mpirun --bind-to none: Open MPI binds a lone rank to one core)
  gemm-2x1  tests/bench/gemm-config.json (hidden 512, 8 layers, 8 heads, SwiGLU 1376; 25.4M
            parameters), seq-len 256, 2 ranks x 1 thread: the GEMMs dominate
  tp2-2x1   TP 2 x 1 thread (issue 40): `demo` as demo-2x1, shardtrain `--tp 2` at W = 2 (no data
            parallelism) against the peer's `--tp 2` ("torch-tp": parallelize_module with
            torchtitan's Llama plan, ColwiseParallel / RowwiseParallel / SequenceParallel, gloo,
            eager), the only programs of this case; the FSDP2 peers do not run in it
Long-context cases (issue 41): tests/bench/cp-config.json (hidden 128, 2 layers, 2 heads over 1 KV
head, so that attention dominates), seq-len LONG_T = 16,384, global batch 2, 2 ranks x 1 thread.
Their peer is the same shardtrain binary with other arguments ("shardtrain-ref", the case's
ref_args in place of its args), the only peer they run:
  cp2-ring    --cp 2 --cp-comm ring against plain data parallelism at W = 2 (no --cp) over the
              same global batch: the CP group of both ranks holds both sequences, half of each
  cp2-gather  the same with --cp-comm allgather
  doc-vs-causal  --attention-mask document against causal (both without CP, W = 2) on a corpus of
              short documents (64 to 512 tokens, BOS ... EOS, random bytes) that this script
              writes to OUT/short-docs.tok (never ../shared data)
Pipeline cases (issue 42): `demo` as demo-2x1, micro-batch 3 (4 micro-batches per step), the case's
pp_args given to both programs: shardtrain `--pp 2` against "torch-pp" (tests/bench/peer_torch_pp.py:
torch.distributed.pipelining, gloo, the same split, weights and batches), the only programs of these
cases; skipped, with the message "shardtrain has no --pp", while `shardtrain --help` lists no --pp:
  pp2-1f1b         --pp 2 --pp-schedule 1f1b (Schedule1F1B)
  pp2-interleaved  --pp 2 --pp-schedule interleaved --pp-virtual 2 (ScheduleInterleaved1F1B, 4 chunks)
Their runs also report, as means over the window's steps of the metrics: the exposed CP
communication (cp_comm_ms: the time CpAttention waited for its transfers, cp_bytes sent per
rank), FSDP's exposed communication (exposed_comm_ms), and the fraction of attention tile pairs
skipped as fully masked (attn_tiles_skipped / attn_tile_pairs, rank 0's).
Each round runs shardtrain, the peer in eager mode, the peer with torch.compile, one after the
other (A B C A B C ...), so that a change in the machine's load hits every program alike.
Each case runs only the programs it lists in CASE_PROGRAMS.
--baseline BIN adds a fourth program, "baseline": another shardtrain binary (e.g. one built from an
earlier commit) run with the same arguments in the same rounds, so that a refactor's speed is a
ratio against its predecessor measured beside it. --programs picks and orders the programs run.

Every run is launched by the same mpirun command (same process placement: Open MPI binds each of
2 ranks to its own core), each rank wrapped by tests/bench/rank_usage.py; the two shardtrain
binaries run through links of equal path length (equal_length_paths). Measured per run:
* tokens/s over the window: global batch x seq-len x (last step - first window step) divided
  by the difference of the metrics' elapsed_s between those two steps (wall clock of rank 0; the
  first steps are left out: allocation, page faults, and torch.compile's compilation);
* CPU seconds in the window, all ranks: user + system time (/proc/PID/stat, all threads and
  children) of every process under mpirun, read when rank 0 prints the window's first and last
  step lines; also per token;
* CPU seconds of the whole run, all ranks, and peak RSS per rank (wait4 of each rank, in
  rank_usage.py); the whole run includes start-up (importing torch) and compilation;
* warm-up: elapsed_s at the window's first step (compilation included);
* the final training loss (both programs see the same batches from the same initial weights,
  so their losses agree to about 4 digits);
* MFU (issue 30): shardtrain's window tokens/s x FLOPs per token / the CPU peak it measured at
  start-up (its metrics' mfu / tokens_per_s is FLOPs per token / peak); each peer run is given the
  same (same model, same FLOPs, same machine) with the shardtrain run of its round: the peer's
  tokens/s against shardtrain's measured peak. "—" when shardtrain measured none (cores shared).
Prints every run, then the ratios (shardtrain / peer, per round; min and max over rounds) against
issue 12's targets, and writes build/bench/throughput.json (everything) and build/bench/peer.md (a
block for docs/benchmarks.md: machine, date, BLAS of each program, tables). Timings are noisy on
a shared machine; the targets are not asserted.
--quick (BENCH_QUICK=1 in run.sh) cuts every run to a few steps: a smoke test of the harness,
not a benchmark.
"""
import argparse
import ctypes
import datetime
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GLOBAL_BATCH = 12  # every case but those that set global_batch
COMMON = ["--lr", "1e-3", "--min-lr", "1e-4", "--beta2", "0.99",
          "--weight-decay", "0.1", "--clip", "1.0", "--seed", "1337"]
LONG_T = 16384  # the long-context cases' seq-len (issue 41: W = 2, T = 16,384)
# name: config, ranks, threads, seq-len, steps, first step of the window, warm-up, log-every;
# optional: global_batch, tp, args (shardtrain's and baseline's extra arguments), ref_args
# (shardtrain-ref's), data ("short-docs": the corpus this script writes)
CASES = {
    "demo-2x1": dict(config="demo-config.json", np=2, threads=1, seq_len=64, steps=300, window=20, warmup=100, log_every=20),
    "demo-1x2": dict(config="demo-config.json", np=1, threads=2, seq_len=64, steps=300, window=20, warmup=100, log_every=20),
    "gemm-2x1": dict(config="gemm-config.json", np=2, threads=1, seq_len=256, steps=7, window=2, warmup=2, log_every=1),
    "tp2-2x1": dict(config="demo-config.json", np=2, threads=1, seq_len=64, steps=300, window=20, warmup=100, log_every=20, tp=2),
    "cp2-ring": dict(config="cp-config.json", np=2, threads=1, seq_len=LONG_T, steps=5, window=2, warmup=0, log_every=1,
                     global_batch=2, args=["--cp", "2", "--cp-comm", "ring"], ref_args=[]),
    "cp2-gather": dict(config="cp-config.json", np=2, threads=1, seq_len=LONG_T, steps=5, window=2, warmup=0, log_every=1,
                       global_batch=2, args=["--cp", "2", "--cp-comm", "allgather"], ref_args=[]),
    "doc-vs-causal": dict(config="cp-config.json", np=2, threads=1, seq_len=LONG_T, steps=5, window=2, warmup=0,
                          log_every=1, global_batch=2, data="short-docs", args=["--attention-mask", "document"],
                          ref_args=["--attention-mask", "causal"]),
    # Issue 42: PP 2 (1F1B, 8 micro-batches through 2 stages) against FSDP 2 (4 micro-batches per
    # rank), the same global batch, on the GEMM-bound config: tokens/s and the bytes each moves.
    "gemm-pp2-vs-fsdp2": dict(config="gemm-config.json", np=2, threads=1, seq_len=256, steps=7, window=2, warmup=2,
                              log_every=1, global_batch=8, args=["--pp", "2", "--micro-batch", "1"],
                              ref_args=["--micro-batch", "1"]),
    # Issue 56: a Mixtral MoE (tests/bench/moe-config.json: hidden 256, 4 layers, 8 experts of 512,
    # top 2; 13.8M parameters, 4.3M active) with the load-balancing loss per forward call
    # (--aux-loss-scope micro-batch, transformers' definition): against transformers'
    # MixtralForCausalLM under FSDP2 (grouped_mm experts), and --ep 2 against FSDP 2 alone.
    "moe-2x1": dict(config="moe-config.json", np=2, threads=1, seq_len=256, steps=30, window=10, warmup=2,
                    log_every=5, global_batch=8, args=["--aux-loss-scope", "micro-batch"]),
    "moe-ep2-vs-fsdp2": dict(config="moe-config.json", np=2, threads=1, seq_len=256, steps=30, window=10, warmup=2,
                             log_every=5, global_batch=8, args=["--aux-loss-scope", "micro-batch", "--ep", "2"],
                             ref_args=["--aux-loss-scope", "micro-batch"]),
}
QUICK = {"demo-2x1": dict(steps=30, window=10, log_every=10), "demo-1x2": dict(steps=30, window=10, log_every=10),
         "gemm-2x1": dict(steps=3, window=1, log_every=1), "tp2-2x1": dict(steps=30, window=10, log_every=10),
         "cp2-ring": dict(steps=2, window=1, log_every=1), "cp2-gather": dict(steps=2, window=1, log_every=1),
         "doc-vs-causal": dict(steps=2, window=1, log_every=1), "gemm-pp2-vs-fsdp2": dict(steps=3, window=1, log_every=1),
         "moe-2x1": dict(steps=3, window=1, log_every=1), "moe-ep2-vs-fsdp2": dict(steps=3, window=1, log_every=1)}
PROGRAMS = ["shardtrain", "torch-eager", "torch-compile", "torch-tp", "shardtrain-ref"]
FSDP_PEERS = ["shardtrain", "baseline", "torch-eager", "torch-compile"]
SAME_BIN = ["shardtrain", "baseline", "shardtrain-ref"]  # the peer is shardtrain itself, other arguments
# The programs each case runs (those of --programs not listed here are skipped in that case).
CASE_PROGRAMS = {"demo-2x1": FSDP_PEERS, "demo-1x2": FSDP_PEERS, "gemm-2x1": FSDP_PEERS,
                 "tp2-2x1": ["shardtrain", "baseline", "torch-tp"],
                 "cp2-ring": SAME_BIN, "cp2-gather": SAME_BIN, "doc-vs-causal": SAME_BIN,
                 "gemm-pp2-vs-fsdp2": SAME_BIN, "moe-2x1": ["shardtrain", "baseline", "torch-eager"],
                 "moe-ep2-vs-fsdp2": SAME_BIN}
# Pipeline parallelism (issue 42, see the docstring): pp_args go to both programs.
PP_ARGS = ["--pp", "2", "--micro-batch", "3"]
for _c, _s in (("pp2-1f1b", ["1f1b"]), ("pp2-interleaved", ["interleaved", "--pp-virtual", "2"])):
    CASES[_c] = dict(config="demo-config.json", np=2, threads=1, seq_len=64, steps=300, window=20, warmup=100,
                     log_every=20, pp_args=PP_ARGS + ["--pp-schedule"] + _s)
    QUICK[_c] = dict(steps=30, window=10, log_every=10)
    CASE_PROGRAMS[_c] = ["shardtrain", "baseline", "torch-pp"]
PROGRAMS.append("torch-pp")
# (case, peer, minimum of shardtrain tokens/s / peer tokens/s): issue 12; doc-vs-causal: issue 41 (> 1)
TARGETS = [("demo-2x1", "torch-eager", 2.5), ("demo-2x1", "torch-compile", 2.0),
           ("demo-1x2", "torch-compile", 1.5), ("gemm-2x1", "torch-compile", 1.3),
           ("doc-vs-causal", "shardtrain-ref", 1.0), ("moe-2x1", "torch-eager", 1.5)]
# Means over the window's metrics rows, when a run's metrics have them (issue 41's long-context cases).
EXTRA_METRICS = ["cp_comm_ms", "cp_bytes", "cp_collectives", "exposed_comm_ms", "attn_tile_pairs", "attn_tiles_skipped",
                 "fsdp_bytes", "pp_bytes", "pp_comm_ms", "ep_bytes", "ep_comm_ms", "ep_issued_ms"]
SHORT_DOCS = (64, 512)  # document lengths of the short-document corpus, tokens (uniform), BOS ... EOS
# The per-run files of the shardtrain programs, tags of one length (shardtrain-ref is the first binary
# with the case's reference arguments).
FILE_LABEL = {"shardtrain": "bin1", "baseline": "bin2", "shardtrain-ref": "ref1"}
RSS_TARGET = 0.5  # shardtrain's largest rank's peak RSS / the peer's, at most


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(root):
    """PIDs of every process below `root` (not root itself), from /proc."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cpu_seconds(root):
    """User + system seconds of every process under `root`, and of their reaped children."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def global_batch(case):
    return case.get("global_batch", GLOBAL_BATCH)


def has_pp(binary):
    """Whether `binary --help` lists --pp (pipeline parallelism, issue 42)."""
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return re.search(r"(?m)^\s*--pp\b", out) is not None


def write_short_docs(path, n_train=1 << 20, n_val=1 << 16, seed=41):
    """A byte-level shardtrain token file (format version 1, as tests/e2e/test_cp_matrix.sh writes
    one) of short documents: each BOS, random bytes, EOS, its length uniform in SHORT_DOCS."""
    import array
    import random
    BOS, EOS, V = 256, 257, 258
    rnd = random.Random(seed)

    def split(n):
        out = array.array("H")
        while len(out) < n:
            k = rnd.randint(*SHORT_DOCS)
            out.append(BOS)
            out.extend(rnd.randrange(256) for _ in range(k - 2))
            out.append(EOS)
        return out[:n]
    train, val = split(n_train), split(n_val)
    head = b"STTOKv1\0" + struct.pack("<6I", 1, V, BOS, EOS, 2, 0) + struct.pack("<2Q", len(train), len(val))
    head += b"byte-level".ljust(16, b"\0")
    if sys.byteorder != "little":
        train.byteswap(), val.byteswap()
    with open(path, "wb") as f:
        f.write(head + train.tobytes() + val.tobytes())


def run_one(a, case_name, case, program, rnd):
    # The two binaries' files get tags of one length (their paths are in each rank's command line and
    # in Open MPI's OMPI_ARGV environment variable: equal_length_paths).
    tag = f"{case_name}-{FILE_LABEL.get(program, program)}-r{rnd}"
    log, metrics, usage = (os.path.join(a.out, "peer", tag + ext) for ext in (".log", ".jsonl", ""))
    for f in [log, metrics] + [f"{usage}.rank{r}.json" for r in range(case["np"])]:
        if os.path.exists(f):
            os.remove(f)
    data = a.short_docs if case.get("data") == "short-docs" else a.data
    tail = ["--model", os.path.join(HERE, case["config"]), "--data", data, "--seq-len", str(case["seq_len"]),
            "--steps", str(case["steps"]), "--warmup", str(case["warmup"]), "--log-every", str(case["log_every"]),
            "--threads", str(case["threads"]), "--metrics", metrics, "--global-batch", str(global_batch(case))] + COMMON
    if case.get("tp", 1) > 1:  # both programs: TP over the case's ranks
        tail += ["--tp", str(case["tp"])]
    tail += case.get("pp_args", [])  # both programs: pipeline parallelism (issue 42)
    if program in SAME_BIN:
        extra = case.get("ref_args" if program == "shardtrain-ref" else "args", [])
        cmd = [a.run_bin[program], "--eval-every", "0", "--eval-batches", "1"] + tail + extra
    else:
        cmd = [a.python, os.path.join(HERE, "peer_torch.py"), "--port", str(free_port())] + tail
        if program == "torch-compile":
            cmd.append("--compile")
        if program == "torch-pp":
            cmd[1] = os.path.join(HERE, "peer_torch_pp.py")
    launcher = ["mpirun", "--oversubscribe", "-np", str(case["np"])] + (["--bind-to", "none"] if case["np"] == 1 else [])
    full = launcher + [sys.executable, os.path.join(HERE, "rank_usage.py"), usage, "--"] + cmd
    w0, last = case["window"], case["steps"]
    cpu = {}
    t0 = time.perf_counter()
    with open(log, "w") as lf:
        lf.write("$ " + " ".join(full) + "\n")
        if program in a.run_bin:
            lf.write(f"# {a.run_bin[program]} -> {os.readlink(a.run_bin[program])}\n")
        p = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env=run_env(a))
        for line in p.stdout:
            lf.write(line)
            for step in (w0, last):
                if line.startswith(f"step {step}/") and step not in cpu:
                    cpu[step] = cpu_seconds(p.pid)
        rc = p.wait()
    wall = time.perf_counter() - t0
    r = dict(case=case_name, program=program, round=rnd, rc=rc, wall_s=wall, log=log)
    ranks = []
    for k in range(case["np"]):
        try:
            with open(f"{usage}.rank{k}.json") as f:
                ranks.append(json.load(f))
        except OSError:
            rc = rc or 1
    rows = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            rows = [json.loads(x) for x in f if x.strip()]
    by_step = {x["step"]: x for x in rows if "loss" in x}
    if rc != 0 or w0 not in by_step or last not in by_step or len(cpu) < 2:
        r["rc"] = rc or 1
        with open(log) as f:
            r["error"] = "".join(f.readlines()[-15:])
        return r
    tokens = global_batch(case) * case["seq_len"] * (last - w0)
    dt = by_step[last]["elapsed_s"] - by_step[w0]["elapsed_s"]
    r.update(tokens_per_s=tokens / dt, window_cpu_s=cpu[last] - cpu[w0], window_tokens=tokens,
             cpu_s_per_1k_tokens=1000 * (cpu[last] - cpu[w0]) / tokens, run_cpu_s=sum(x["cpu_s"] for x in ranks),
             rss_mib=[x["maxrss_mib"] for x in ranks], warmup_s=by_step[w0]["elapsed_s"],
             first_loss=by_step[min(by_step)]["loss"], final_loss=by_step[last]["loss"])
    # MFU: FLOPs per token / the job's peak, from any row that has an mfu (the peak is the run's).
    per = [x["mfu"] / x["tokens_per_s"] for x in by_step.values() if "mfu" in x and x.get("tokens_per_s")]
    if per:
        r["flops_per_peak"] = per[-1]
        r["mfu"] = r["tokens_per_s"] * per[-1]
    window = [x for s, x in by_step.items() if w0 < s <= last]
    for k in EXTRA_METRICS:
        v = [x[k] for x in window if k in x]
        if v:
            r[k] = sum(v) / len(v)
    if r.get("attn_tile_pairs"):
        r["skipped_fraction"] = r.get("attn_tiles_skipped", 0.0) / r["attn_tile_pairs"]
    with open(log) as f:
        m = re.search(r"(?m)^(CPU peak .*|MFU peak: .*|MFU n/a .*)$", f.read())
    if m:
        r["peak_line"] = m.group(1)
    return r


def equal_length_paths(a):
    """The paths the two shardtrain binaries run under: symbolic links of equal length to the files
    --bin and --baseline name, resolved before any link is re-pointed (OUT/bin/1/shardtrain,
    OUT/bin/2/shardtrain). With FILE_LABEL's tags of one length, the two programs' command lines and
    environments (argv[0]; Open MPI's OMPI_ARGV) then have the same lengths: a difference of path
    length alone moved one binary's demo-2x1 by about 4% (docs/benchmarks.md, issue 40, "the
    harness's path-length bias"). Not equalized: AT_EXECFN after shardtrain's BLAS re-exec through
    /proc/self/exe. Exits naming the option when a binary is not an executable file, or OUT/bin
    when a link cannot be made."""
    targets = {}
    for prog, opt, given in (("shardtrain", "--bin", a.bin), ("baseline", "--baseline", a.baseline)):
        if not given:
            continue
        real = os.path.realpath(given)  # before any link below is re-pointed: links of an earlier run resolve to their files
        if not (os.path.isfile(real) and os.access(real, os.X_OK)):
            sys.exit(f"throughput.py: {opt} '{given}': not an executable file")
        targets[prog] = real
    paths = {}
    for i, prog in enumerate(("shardtrain", "baseline"), start=1):
        if prog not in targets:
            continue
        link = os.path.join(a.out, "bin", str(i), "shardtrain")
        try:
            os.makedirs(os.path.dirname(link), exist_ok=True)
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(targets[prog], link)
        except OSError as e:
            sys.exit(f"throughput.py: cannot make the link {link} for {prog} (--out '{a.out}'): {e.strerror}")
        paths[prog] = link
    if "shardtrain" in paths:  # the same binary, the case's reference arguments
        paths["shardtrain-ref"] = paths["shardtrain"]
    return paths


def describe(r):
    if r["rc"] != 0:
        return f"{r['case']:9} {r['program']:13} round {r['round']}: FAILED (exit {r['rc']}), see {r['log']}\n{r.get('error', '')}"
    return (f"{r['case']:9} {r['program']:13} round {r['round']}: {r['tokens_per_s']:8.0f} tok/s, "
            f"CPU {r['window_cpu_s']:6.1f} s in window ({r['cpu_s_per_1k_tokens']:.3f} s/1k tokens), "
            f"{r['run_cpu_s']:6.1f} s whole run; peak RSS/rank " + "/".join(f"{x:.0f}" for x in r["rss_mib"])
            + f" MiB; warm-up {r['warmup_s']:.1f} s; loss {r['first_loss']:.4f} -> {r['final_loss']:.4f}; wall {r['wall_s']:.0f} s"
            + (f"; MFU {100 * r['mfu']:.1f}%" if "mfu" in r else "") + extras(r))


def extras(r):
    """The long-context metrics of a run, for its line: CP and FSDP exposed communication, skipped tiles."""
    out = ""
    if "cp_comm_ms" in r:
        out += f"; CP comm exposed {r['cp_comm_ms']:.1f} ms/step ({r.get('cp_bytes', 0) / 1e6:.1f} MB/step)"
    if "cp_comm_ms" in r or "skipped_fraction" in r:
        out += f"; FSDP exposed {r.get('exposed_comm_ms', 0):.1f} ms/step"
    if "skipped_fraction" in r:
        out += f"; attention tiles skipped {100 * r['skipped_fraction']:.1f}% of {r['attn_tile_pairs']:,.0f}/step"
    return out


def ratios(results, case, peer):
    """Per round: shardtrain / peer tokens/s, peer / shardtrain CPU per token, shardtrain / peer max RSS."""
    out = []
    ok = {(r["program"], r["round"]): r for r in results if r["case"] == case and r["rc"] == 0}
    for (prog, rnd), s in sorted(ok.items()):
        if prog == "shardtrain" and (peer, rnd) in ok:
            q = ok[(peer, rnd)]
            out.append((s["tokens_per_s"] / q["tokens_per_s"], q["cpu_s_per_1k_tokens"] / s["cpu_s_per_1k_tokens"],
                        max(s["rss_mib"]) / max(q["rss_mib"])))
    return out


def mfu_scale(results, case, rnd):
    """[FLOPs per token / peak] of the shardtrain run of `case` in round `rnd`, or [] (none measured)."""
    return [r["flops_per_peak"] for r in results
            if r["case"] == case and r["round"] == rnd and r["program"] == "shardtrain" and r["rc"] == 0
            and "flops_per_peak" in r]


def peers(a, case=None):
    """The programs shardtrain is compared with, in round order (those `case` runs, if given)."""
    return [x for x in a.programs if x != "shardtrain" and (case is None or x in CASE_PROGRAMS[case])]


def first_losses(results, case):
    """{program: [first logged loss of each successful run]} of `case` (step 1: same weights, same batch)."""
    out = {}
    for r in results:
        if r["case"] == case and r["rc"] == 0:
            out.setdefault(r["program"], []).append(r["first_loss"])
    return out


def span(xs, f="{:.2f}"):
    return "—" if not xs else (f.format(min(xs)) if len(xs) == 1 else f"{f.format(min(xs))} – {f.format(max(xs))}")


TORCH_INFO = """
import re, torch, transformers
c = torch.__config__.show()
mkl = re.search(r"Math Kernel Library Version (\\S+)", c)
blas = ("MKL " + mkl.group(1)) if mkl else re.search(r"BLAS_INFO=(\\w+)", c).group(1)
cap = re.search(r"CPU capability usage: (\\S+)", c)
print(f"PyTorch {torch.__version__} (BLAS {blas}, CPU capability {cap.group(1) if cap else '?'}), "
      f"transformers {transformers.__version__}")
"""


# OpenBLAS's kernel choice read from the environment (architecture.md, "BLAS"): shardtrain honours
# them; the PyTorch peer's MKL never reads them. A machine's environment that sets them below what
# the CPU runs (a CI image's OPENBLAS_CORETYPE=Haswell on an AVX-512 CPU) measures shardtrain's
# GEMMs at an older instruction set than the peer's: --blas-env cpu drops them from every run, so
# that each program picks its kernels from the CPU, as on a machine where they are unset.
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def run_env(a):
    return {k: v for k, v in os.environ.items() if a.blas_env == "inherit" or k not in BLAS_ENV}


def blas_env_note(a):
    """One sentence: which of BLAS_ENV the runs had, and from where."""
    have = [f"{k}={os.environ[k]}" for k in BLAS_ENV if k in os.environ]
    if not have:
        return "OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (each program picks its kernels from the CPU)"
    if a.blas_env == "cpu":
        return (f"the environment's {', '.join(have)} dropped from every run (`--blas-env cpu`: each program "
                "picks its kernels from the CPU)")
    return (f"{', '.join(have)} inherited from the environment (`--blas-env inherit`): shardtrain's OpenBLAS "
            "uses them, the peer's MKL ignores them")


def environment(a, results):
    def sh(cmd):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "cpu": sh("lscpu | sed -n 's/^Model name: *//p'"), "cores": os.cpu_count()}
    blas = ""  # what shardtrain says about its BLAS, if it says anything
    for r in results:
        if r["program"] == "shardtrain" and os.path.exists(r["log"]):
            with open(r["log"]) as f:
                m = re.search(r"(?im)^.*(openblas|kernel set|corename).*$", f.read())
            if m:
                blas = m.group(0).strip()
                break
    if not blas:
        try:
            lib = ctypes.CDLL("libopenblas.so.0")
            lib.openblas_get_corename.restype = lib.openblas_get_config.restype = ctypes.c_char_p
            blas = (f"{lib.openblas_get_config().decode()}; openblas_get_corename() = "
                    f"{lib.openblas_get_corename().decode()}")
        except (OSError, AttributeError):
            blas = "unknown (libopenblas.so.0 not loadable)"
    env["shardtrain_blas"] = blas
    env["blas_env"] = blas_env_note(a)
    try:
        env["torch"] = subprocess.run([a.python, "-c", TORCH_INFO], capture_output=True, text=True,
                                      timeout=300).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["torch"] = "PyTorch: unknown"
    env["mpirun"] = sh("mpirun --version | head -1")
    return env


def markdown(a, results, env):
    L = [f"### Against the PyTorch peer, {env['date']}", "",
         f"`make bench` part 2 (`tests/bench/throughput.py`){' — QUICK SMOKE RUN, NOT A BENCHMARK' if a.quick else ''}: "
         f"{a.rounds} round(s), programs interleaved in each round. Machine: {env['cpu']}, {env['cores']} cores "
         f"(`lscpu`, `nproc`); {env['mpirun']}.",
         f"shardtrain's BLAS: {env['shardtrain_blas']}; {env['blas_env']}.",
         f"Peer: `tests/bench/peer_torch.py`, {env['torch']}; FSDP2 (`fully_shard` per decoder layer and on the "
         "model), gloo, same config.json, data, batches, initial weights, schedule and AdamW settings; "
         "tp2-2x1: shardtrain `--tp 2` against the peer's `--tp 2` (torch-tp: `parallelize_module`, torchtitan's "
         "Llama plan, ColwiseParallel q/k/v and gate/up, RowwiseParallel o/down, SequenceParallel norms, "
         "embedding and head split by vocabulary, eager, gloo)."
         + (" Long-context cases (cp2-ring, cp2-gather, doc-vs-causal): the peer is the same shardtrain binary "
            "(shardtrain-ref): cp2-*: `--cp 2` against plain data parallelism at W = 2 (no `--cp`) over the same "
            "global batch; doc-vs-causal: `--attention-mask document` against `causal` on the short-document corpus "
            f"the script writes ({SHORT_DOCS[0]}-{SHORT_DOCS[1]} tokens per document)."
            if any("ref_args" in CASES[c] for c in a.cases) else ""),
         f"Data: `{os.path.relpath(a.data)}`. Common settings: {' '.join(COMMON)}; global batch {GLOBAL_BATCH} "
         "unless a case says otherwise."
         + (f" baseline: `{a.baseline}` (same arguments as shardtrain, `{a.bin}`)." if a.baseline else ""), "",
         "| case | program | tokens/s | CPU-s per 1k tokens (window, all ranks) | peak RSS of the largest rank, MiB | warm-up, s | final loss | MFU (shardtrain's measured CPU peak) |",
         "|---|---|---:|---:|---:|---:|---:|---:|"]
    peaks = []
    for cn in a.cases:
        for prog in [x for x in a.programs if x in CASE_PROGRAMS[cn]]:
            rs = [r for r in results if r["case"] == cn and r["program"] == prog and r["rc"] == 0]
            if not rs:
                L.append(f"| {cn} | {prog} | failed | | | | | |")
                continue
            mfu = [100 * r["tokens_per_s"] * fp for r in rs for fp in mfu_scale(results, cn, r["round"])]
            peaks += [f"{cn} round {r['round']}: {r['peak_line']}" for r in rs if prog == "shardtrain" and "peak_line" in r]
            L.append(f"| {cn} | {prog} | {span([r['tokens_per_s'] for r in rs], '{:,.0f}')} | "
                     f"{span([r['cpu_s_per_1k_tokens'] for r in rs], '{:.3f}')} | "
                     f"{span([max(r['rss_mib']) for r in rs], '{:.0f}')} | {span([r['warmup_s'] for r in rs], '{:.1f}')} | "
                     f"{span([r['final_loss'] for r in rs], '{:.4f}')} | {span(mfu, '{:.1f}%')} |")
    L += ["", "Cases: " + "; ".join(
        f"{cn}: `{CASES[cn]['config']}`, {CASES[cn]['np']} rank(s) x {CASES[cn]['threads']} thread(s), seq-len "
        f"{CASES[cn]['seq_len']}, global batch {global_batch(CASES[cn])}, {CASES[cn]['steps']} steps timed from step "
        f"{CASES[cn]['window']}, warm-up {CASES[cn]['warmup']}"
        + (f", shardtrain `{' '.join(CASES[cn]['args'])}` against shardtrain-ref `{' '.join(CASES[cn]['ref_args']) or '(none)'}`"
           if "ref_args" in CASES[cn] else "") for cn in a.cases) + ". Ranges are min – max over rounds. MFU: tokens/s x "
        "FLOPs per token (PaLM's 6N + 12LHQT, docs/monitoring.md) / the CPU peak shardtrain measured at start-up in the same "
        "round, the peers' tokens/s against that same peak. shardtrain's peaks:", ""] + [f"* {x}" for x in peaks] + ["",
        "| shardtrain against | tokens/s ratio | target | met | CPU-s per token, peer / shardtrain | peak RSS, shardtrain / peer | ≤ 0.5 |",
        "|---|---:|---|---|---:|---:|---|"]
    for cn in a.cases:
        for peer in peers(a, cn):
            rr = ratios(results, cn, peer)
            tgt = [t for c, p, t in TARGETS if c == cn and p == peer]
            tok, rss = [x[0] for x in rr], [x[2] for x in rr]
            met = "—" if not (rr and tgt) else ("yes" if min(tok) >= tgt[0] else "no")
            rss_met = "—" if not rr or peer in ("baseline", "shardtrain-ref") else ("yes" if max(rss) <= RSS_TARGET else "no")
            L.append(f"| {cn}, {peer} | {span(tok)} | {'≥ %.1f' % tgt[0] if tgt else '—'} | {met} | "
                     f"{span([x[1] for x in rr])} | {span(rss)} | {rss_met} |")
    L += ["", "Ratios are per round (shardtrain's run against the peer's run of the same round), min – max "
          "over rounds; a target counts as met when the smallest round meets it.", ""]
    long_runs = [r for r in results if r["rc"] == 0 and "ref_args" in CASES[r["case"]]]
    if long_runs:
        L += ["Long-context runs: means over the window's steps of the metrics (per step; rank 0's tile counts).", "",
              "| case | program | CP comm exposed, ms | CP MB sent per rank | FSDP exposed comm, ms | attention tiles skipped |",
              "|---|---|---:|---:|---:|---:|"]
        for cn in a.cases:
            for prog in [x for x in a.programs if x in CASE_PROGRAMS[cn]]:
                rs = [r for r in long_runs if r["case"] == cn and r["program"] == prog]
                if not rs:
                    continue
                cp = [r["cp_comm_ms"] for r in rs if "cp_comm_ms" in r]
                mb = [r["cp_bytes"] / 1e6 for r in rs if "cp_bytes" in r]
                sk = [100 * r["skipped_fraction"] for r in rs if "skipped_fraction" in r]
                L.append(f"| {cn} | {prog} | {span(cp, '{:.1f}')} | {span(mb, '{:.1f}')} | "
                         f"{span([r.get('exposed_comm_ms', 0) for r in rs], '{:.1f}')} | {span(sk, '{:.1f}%')} |")
        L.append("")
    L += [
          "First step's loss (same weights, same batch), min – max over rounds: " + "; ".join(
              f"{cn}: " + ", ".join(f"{prog} {span(v, '{:.6f}')}" for prog, v in first_losses(results, cn).items())
              for cn in a.cases) + "."]
    return "\n".join(L) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--bin", default="build/shardtrain")
    p.add_argument("--python", default=".venv/bin/python")
    p.add_argument("--out", default="build/bench")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--baseline", default="", help="another shardtrain binary, run as program 'baseline'")
    p.add_argument("--programs", default="", help="comma-separated, in round order; default: shardtrain[,baseline],"
                   + ",".join(PROGRAMS[1:]))
    p.add_argument("--blas-env", choices=["inherit", "cpu"], default="inherit",
                   help="inherit: runs see the environment's OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE; cpu: both dropped, "
                   "each program picks its BLAS kernels from the CPU (see BLAS_ENV)")
    a = p.parse_args()
    a.programs = [x for x in (a.programs or ",".join(PROGRAMS[:1] + (["baseline"] if a.baseline else []) + PROGRAMS[1:])).split(",") if x]
    for x in a.programs:
        if x not in PROGRAMS + ["baseline"]:
            sys.exit(f"throughput.py: unknown program '{x}' (known: {', '.join(PROGRAMS + ['baseline'])})")
    if "baseline" in a.programs and not a.baseline:
        sys.exit("throughput.py: program 'baseline' needs --baseline BIN")
    if "shardtrain" not in a.programs:
        sys.exit("throughput.py: --programs must include shardtrain (every ratio is against it)")
    a.cases = [c for c in a.cases.split(",") if c]
    for c in a.cases:
        if c not in CASES:
            sys.exit(f"throughput.py: unknown case '{c}' (known: {', '.join(CASES)})")
        if a.quick:
            CASES[c].update(QUICK[c])
    pp_cases = [c for c in a.cases if "pp_args" in CASES[c]]
    if pp_cases and not has_pp(a.bin):
        print(f"throughput.py: skipping {', '.join(pp_cases)}: shardtrain has no --pp (not in `{a.bin} --help`)")
        a.cases = [c for c in a.cases if c not in pp_cases]
    os.makedirs(os.path.join(a.out, "peer"), exist_ok=True)
    a.short_docs = os.path.join(a.out, "short-docs.tok")
    if any(CASES[c].get("data") == "short-docs" for c in a.cases):
        write_short_docs(a.short_docs)
    a.run_bin = equal_length_paths(a)
    print(f"BLAS environment: {blas_env_note(a)}", flush=True)
    results = []
    for cn in a.cases:
        for rnd in range(1, a.rounds + 1):
            for prog in [x for x in a.programs if x in CASE_PROGRAMS[cn]]:
                r = run_one(a, cn, CASES[cn], prog, rnd)
                results.append(r)
                print(describe(r), flush=True)
    print("\nratios, per round (shardtrain / peer tokens/s; peer / shardtrain CPU-s per token; "
          "shardtrain / peer peak RSS of the largest rank):")
    for cn in a.cases:
        for peer in peers(a, cn):
            rr = ratios(results, cn, peer)
            tgt = [t for c, pp, t in TARGETS if c == cn and pp == peer]
            print(f"  {cn} vs {peer:13}: tokens/s {span([x[0] for x in rr])}"
                  + (f" (target >= {tgt[0]})" if tgt else "")
                  + f"; CPU per token {span([x[1] for x in rr])}; peak RSS {span([x[2] for x in rr])}"
                  + (f" (target <= {RSS_TARGET})" if peer not in ("baseline", "shardtrain-ref") else ""))
    print("first step's loss (same weights, same batch):")
    for cn in a.cases:
        fl = first_losses(results, cn)
        allv = [x for v in fl.values() for x in v]
        print(f"  {cn}: " + ", ".join(f"{prog} {span(v, '{:.6f}')}" for prog, v in fl.items())
              + (f"; largest difference {max(allv) - min(allv):.1e}" if allv else ""))
    env = environment(a, results)
    with open(os.path.join(a.out, "throughput.json"), "w") as f:
        json.dump({"environment": env, "cases": {c: CASES[c] for c in a.cases}, "quick": a.quick, "runs": results}, f, indent=1)
    md = markdown(a, results, env)
    with open(os.path.join(a.out, "peer.md"), "w") as f:
        f.write(md)
    print(f"\nwrote {os.path.join(a.out, 'peer.md')} (for docs/benchmarks.md) and throughput.json")
    sys.exit(1 if any(r["rc"] != 0 for r in results) else 0)


if __name__ == "__main__":
    main()
