"""make bench, part 8: supervised fine-tuning on chat data (issue 55), interleaved.

Usage: .venv/bin/python tests/bench/sft.py [--bin build/shardtrain] [--out build/bench] [--rounds 3] [--quick]

Data and model (written under OUT/sft/ by this script; nothing from ../shared):
* tests/e2e/chat_make.py's fixtures: its byte-level BPE tokenizer with the ChatML template and
  {% generation %} markers (chatml-gen, vocabulary 600) and its 50 conversations (chat.jsonl),
  repeated REPEAT = 4 times (200 conversations) and written by scripts/tokenize_hf.py as token
  format v3 (sft.tok): the last 10% of the examples are its validation split, the first 180 its
  training split (45,616 tokens, the longest conversation 874 tokens).
* A random LlamaForCausalLM made here with transformers (hidden 256, 4 layers, 4 heads over 2 KV
  heads, SwiGLU 688, untied, vocabulary = the tokenizer's, 1024 positions, RMSNorm eps 1e-5, RoPE
  theta 10000, seed 55; 3.2M parameters), imported with `shardtrain --mode import` (base.h5):
  every program starts from the same weights.
* Every shardtrain run: one rank (mpirun -np 1 --bind-to none: Open MPI binds a lone rank to one
  core), --threads 2, fp32, --init-from base.h5, AdamW lr 1e-3 constant (--min-lr 1e-3
  --warmup 0), beta2 0.95, weight decay 0, clip 1.0 (TRL's settings below), --eval-every 0
  --eval-batches 1 (shardtrain evaluates once at the end; outside the training time and the
  window's CPU seconds, inside the whole run's). shardtrain runs from a copy of --bin made at the
  start (OUT/sft/shardtrain), so that a rebuild during the bench cannot change the binary between
  rounds.

Part 1, SFT against plain training on the same tokens (ratio target >= 0.95): "sft" trains on
sft.tok (default packing: best-fit decreasing into rows of SEQ_LEN = 1024, the document mask, loss
on the assistant tokens); "plain" on plain.tok, a version 2 file holding sft.tok's training split's
tokens (the conversations back to back) as its training split and its validation split's as its
validation split (shardtrain_tokens.TokenFileWriter), with the default causal mask and windows of
1024 tokens at random offsets. Both: global batch 4 rows, P1_STEPS steps. Compared: tokens/s of
shardtrain's "done: N steps in X s of training, Y tok/s" line, which counts positions (rows x
seq-len, the packed rows' padding included).

Part 2, shardtrain against TRL's SFTTrainer (ratio target >= 2): the same 180 training
conversations, one epoch, the same optimizer steps and batch.
* "trl": SFTTrainer(assistant_only_loss=True, packing=False, max_length=None), one process, CPU,
  fp32 (no bf16, no activation checkpointing), torch.set_num_threads(2) (OMP_NUM_THREADS and
  MKL_NUM_THREADS 2 before torch is imported), per-device batch 4 conversations x gradient
  accumulation 3 = 12 conversations a step, train_sampling_strategy "sequential" (the file's
  order), optim adamw_torch with the settings above, P2_STEPS = 180 / 12 = 15 steps. transformers'
  default attention (sdpa); TRL pads each micro-batch to its longest conversation.
* "none": shardtrain --pack none --shuffle off --seq-len 1024 --global-batch 12 --micro-batch 4:
  the same 12 conversations a step, in the same order, one a row, each row padded to 1024. Its 15
  step losses are compared with TRL's (the same weights and batches: equal within ~1e-5).
* "packed": shardtrain's default (best-fit packing, the document mask, shuffled rows, one
  micro-batch a step), seq-len 1024, global batch round(12 R / 180) rows (R = the rows the 180
  conversations pack into, read from `--mode plan`; 45 rows: 3 rows a step, the 15 steps one epoch
  exactly), so that a step holds the conversations of 12 on average.
* "packed-mb1": the same with that batch in micro-batches of a third when 3 divides it
  (--micro-batch 1 for 3 rows): 3 accumulation steps a step, as TRL's (each micro-batch ~1,000
  conversation tokens in both).
Compared: conversation tokens (not padding) per second of training time. Training time: shardtrain's
elapsed_s of the last step in its metrics (from just before step 1 to the end of the last step);
TRL's from its on_train_begin callback to the last on_step_end. Both include step 1; neither
includes start-up (imports, model load, the packing, TRL's tokenizing of the conversations with
the chat template, which shardtrain's users do beforehand with scripts/tokenize_hf.py: its time is
printed once). Conversation tokens: TRL's, the attention mask's sum over every micro-batch it
trained on; shardtrain --pack none's, the lengths of the examples its rows held (file order);
packed, the epoch's tokens x rows trained / R (exact when the steps cover whole epochs, else the
rows past the last whole epoch counted at the epoch's mean fill; the table says which).

Measured for every run: wall time of the whole run (start-up included) and its CPU seconds (user +
system, getrusage RUSAGE_CHILDREN of this script around the run: every process of it, reaped);
CPU seconds in the training window (shardtrain: /proc of every process under mpirun, read at the
last log line before step 1 and at the last step's line; TRL: time.process_time() of its process at
the same two callbacks); peak RSS (shardtrain's VmHWM line, TRL's ru_maxrss). Each round runs every
program of a part once, one after the other (part 1: sft plain, ...; part 2: trl packed packed-mb1
none, ...), so that a change in the machine's load hits each alike; ratios are per round. Timings
are noisy on a shared machine; the targets are not asserted. Writes OUT/sft.md (the block for docs/benchmarks.md)
and OUT/sft.json (everything). --quick: every run cut to 2 steps, a smoke test of the harness, not
a benchmark.
"""
import argparse
import datetime
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
REPEAT = 4  # chat.jsonl's 50 conversations, 4 times: 180 training conversations
SEQ_LEN = 1024
THREADS = 2
P1_BATCH, P1_STEPS = 4, 12  # part 1: global batch in rows, steps
TRL_BATCH, TRL_ACCUM = 4, 3  # part 2: conversations per micro-batch, micro-batches per step
SEED = 55
OPT = ["--lr", "1e-3", "--min-lr", "1e-3", "--warmup", "0", "--beta2", "0.95", "--weight-decay", "0", "--clip", "1.0"]
TARGETS = {"sft/plain": 0.95, "packed/trl": 2.0, "none/trl": 2.0}
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


# ---- processes and their CPU time ----
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


def tree_cpu_seconds(root):
    """User + system seconds of `root` and every process under it, and of their reaped children."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in [root] + descendants(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def children_cpu():
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def run_logged(cmd, log, on_line=None, env=None):
    """Runs cmd with its output (stdout and stderr) to `log`; on_line(line, pid) for every line.
    Returns (exit status, wall seconds, CPU seconds of the whole run)."""
    c0, t0 = children_cpu(), time.perf_counter()
    with open(log, "w") as lf:
        lf.write("$ " + " ".join(cmd) + "\n")
        lf.flush()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
        for line in p.stdout:
            lf.write(line)
            if on_line:
                on_line(line, p.pid)
        rc = p.wait()
    return rc, time.perf_counter() - t0, children_cpu() - c0


def tail(path, n=15):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def check(cmd, log, what):
    rc, wall, _ = run_logged(cmd, log)
    if rc != 0:
        print(tail(log, 30))
        sys.exit(f"sft.py: {what} failed (exit {rc}); see {log}")
    return wall


# ---- shardtrain runs ----
def shardtrain_run(a, name, rnd, data, extra, steps):
    """One shardtrain training run (one rank, THREADS threads); its figures as a dict."""
    tag = f"{name}-r{rnd}"
    log, metrics = os.path.join(a.work, tag + ".log"), os.path.join(a.work, tag + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = ["mpirun", "-np", "1", "--bind-to", "none", a.run_bin, "--model", a.config, "--init-from", a.base,
           "--data", data, "--seq-len", str(SEQ_LEN), "--threads", str(THREADS), "--steps", str(steps),
           "--eval-every", "0", "--eval-batches", "1", "--log-every", "1", "--metrics", metrics] + OPT + extra
    cpu = {}

    def on_line(line, pid):
        if line.startswith("step "):
            if "start" not in cpu:
                cpu["start"] = cpu.get("before", 0.0)
            if line.startswith(f"step {steps}/{steps} "):
                cpu["end"] = tree_cpu_seconds(pid)
        elif "start" not in cpu:
            cpu["before"] = tree_cpu_seconds(pid)  # the last line before step 1 (the overlap line)
    rc, wall, run_cpu = run_logged(cmd, log, on_line)
    r = dict(program=name, round=rnd, rc=rc, wall_s=wall, cpu_s=run_cpu, log=os.path.relpath(log), cmd=cmd)
    text = open(log, errors="replace").read()
    rows = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    by_step = {x["step"]: x for x in rows if "loss" in x}
    m = re.search(r"(?m)^done: (\d+) steps in ([0-9.]+) s of training, ([0-9.]+) tok/s", text)
    if rc != 0 or not m or steps not in by_step or "end" not in cpu:
        r["rc"] = rc or 1
        r["error"] = tail(log)
        return r
    r.update(done_tok_s=float(m.group(3)), done_s=float(m.group(2)), train_s=by_step[steps]["elapsed_s"],
             positions=int(by_step[steps].get("tokens_seen", 0)), window_cpu_s=cpu["end"] - cpu["start"],
             losses=[by_step[s]["loss"] for s in sorted(by_step)])
    m = re.search(r"(?m)^memory: peak resident \(VmHWM\) per rank (\d+) MiB", text)
    if m:
        r["rss_mib"] = int(m.group(1))
    m = re.search(r"(?m)^data: train: (\d+) examples; .* in (\d+) rows of \d+ \(--pack (\S+), ([0-9.]+)% tokens, "
                  r"([0-9.]+)% targets", text)
    if m:
        r.update(rows=int(m.group(2)), pack=m.group(3), fill=float(m.group(4)) / 100, target_fill=float(m.group(5)) / 100)
    return r


def blas_line(text):
    """What shardtrain's start-up says about its BLAS: a 'BLAS: ...' line, else the BLAS part of its
    'shardtrain: N ranks ...' line (library, version, build, kernels)."""
    m = re.search(r"(?m)^BLAS: (.*)$", text)
    if m:
        return m.group(1).strip()
    m = re.search(r"(\S*BLAS\b.*?kernels(?: \([^)]*\))?)", text)
    if m:
        return m.group(1)
    m = re.search(r"(?m)^shardtrain: \d+ ranks .*$", text)
    return m.group(0) if m else "unknown (shardtrain logged no BLAS line)"


# ---- TRL run (a separate process: this script with --trl-worker) ----
def trl_run(a, rnd, steps):
    tag = f"trl-r{rnd}"
    log, res = os.path.join(a.work, tag + ".log"), os.path.join(a.work, tag + ".json")
    if os.path.exists(res):
        os.remove(res)
    cmd = [a.python, os.path.abspath(__file__), "--trl-worker", "--model-dir", a.hf, "--tokenizer", a.tokenizer,
           "--conversations", a.jsonl, "--limit", str(a.n_train), "--steps", str(steps), "--result", res]
    rc, wall, run_cpu = run_logged(cmd, log)
    r = dict(program="trl", round=rnd, rc=rc, wall_s=wall, cpu_s=run_cpu, log=os.path.relpath(log), cmd=cmd)
    if rc != 0 or not os.path.exists(res):
        r["rc"] = rc or 1
        r["error"] = tail(log)
        return r
    with open(res) as f:
        r.update(json.load(f))
    return r


def trl_worker(argv):
    """SFTTrainer's run of part 2, in its own process; writes its figures to --result."""
    p = argparse.ArgumentParser()
    for k in ("--model-dir", "--tokenizer", "--conversations", "--result"):
        p.add_argument(k, required=True)
    p.add_argument("--limit", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    w = p.parse_args(argv)
    t0 = time.time()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(THREADS)
    for k, v in (("TRANSFORMERS_VERBOSITY", "error"), ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
                 ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(k, v)
    import tempfile
    import torch
    torch.set_num_threads(THREADS)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import SFTConfig, SFTTrainer
    import trl
    import transformers
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(w.tokenizer, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype=torch.float32, local_files_only=True)
    recs = [json.loads(x) for x in open(w.conversations, encoding="utf-8") if x.strip()][: w.limit]
    ds = Dataset.from_list([{"messages": r["messages"]} for r in recs])
    st = {"tokens": 0, "positions": 0, "micro": 0, "step_end": []}

    class Count(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:
                st["tokens"] += int(inputs["attention_mask"].sum())
                st["positions"] += int(inputs["attention_mask"].numel())
                st["micro"] += 1
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            st["t0"], st["c0"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            st["t1"], st["c1"] = time.perf_counter(), time.process_time()
            st["step_end"].append(st["t1"] - st["t0"])

    with tempfile.TemporaryDirectory() as d:
        cfg = SFTConfig(output_dir=d, assistant_only_loss=True, packing=False, max_length=None, shuffle_dataset=False,
                        train_sampling_strategy="sequential", bf16=False, fp16=False, activation_checkpointing=False,
                        use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, dataloader_num_workers=0,
                        dataset_num_proc=None, disable_tqdm=True, per_device_train_batch_size=TRL_BATCH,
                        gradient_accumulation_steps=TRL_ACCUM, max_steps=w.steps, learning_rate=1e-3,
                        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                        adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch", seed=SEED, data_seed=SEED)
        trainer = Count(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
        trainer.remove_callback(PrinterCallback)
        setup_s = time.time() - t0
        trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    train_s = st["t1"] - st["t0"]
    out = dict(train_s=train_s, window_cpu_s=st["c1"] - st["c0"], conv_tokens=st["tokens"], positions=st["positions"],
               micro_batches=st["micro"], steps=len(st["step_end"]), setup_s=setup_s, step_end_s=st["step_end"],
               losses=[float(h["loss"]) for h in logged], torch_threads=torch.get_num_threads(),
               attn=getattr(model.config, "_attn_implementation", "?"),
               rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               versions=dict(torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__))
    with open(w.result, "w") as f:
        json.dump(out, f)
    print(f"trl: {out['steps']} steps, {out['conv_tokens']} conversation tokens ({out['positions']} positions with "
          f"padding) in {train_s:.1f} s of training ({out['conv_tokens'] / train_s:.0f} tok/s), {out['window_cpu_s']:.1f} "
          f"CPU-s; set-up {setup_s:.1f} s; {torch.get_num_threads()} threads")
    return 0


def make_model(argv):
    """The benchmark's random Llama (MODEL) of the tokenizer's vocabulary, saved for --mode import."""
    hf, tokdir = argv
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tokdir, local_files_only=True)
    cfg = LlamaConfig(vocab_size=len(tok), rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False, hidden_act="silu", attention_dropout=0.0,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **MODEL)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg).float()
    os.makedirs(hf, exist_ok=True)
    model.save_pretrained(hf, safe_serialization=True)
    for f in sorted(os.listdir(tokdir)):
        if os.path.isfile(os.path.join(tokdir, f)):
            shutil.copy(os.path.join(tokdir, f), os.path.join(hf, f))
    print(f"sft.py model: {sum(p.numel() for p in model.parameters())} parameters, vocab {len(tok)}")
    return 0


# ---- set-up ----
def prepare(a):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import numpy as np
    import shardtrain_tokens as st
    w = a.work
    fx = os.path.join(w, "fixtures")
    check([a.python, os.path.join(ROOT, "tests/e2e/chat_make.py"), fx], os.path.join(w, "chat_make.log"), "chat_make.py")
    a.tokenizer = os.path.join(fx, "chatml-gen")
    lines = [x for x in open(os.path.join(fx, "chat.jsonl"), encoding="utf-8").read().splitlines() if x.strip()]
    a.jsonl = os.path.join(w, f"chat-x{REPEAT}.jsonl")
    with open(a.jsonl, "w", encoding="utf-8") as f:
        f.write("\n".join(lines * REPEAT) + "\n")
    a.sft_tok, a.plain_tok = os.path.join(w, "sft.tok"), os.path.join(w, "plain.tok")
    a.tokenize_s = check([a.python, os.path.join(ROOT, "scripts/tokenize_hf.py"), "--tokenizer", a.tokenizer, "--out",
                          a.sft_tok, "--quiet", "--workers", "1", a.jsonl], os.path.join(w, "tokenize.log"),
                         "tokenize_hf.py")
    f = st.read_token_file(a.sft_tok)
    if f["version"] != 3:
        sys.exit(f"sft.py: {a.sft_tok} is format version {f['version']}, not 3")
    starts = np.asarray(f["starts"], dtype=np.int64)
    a.n_train = int((starts < f["n_train"]).sum())  # the training split's examples: the file's first ones
    a.train_tokens, a.n_examples = int(f["n_train"]), len(starts)
    lens = np.diff(np.append(starts, f["n_train"] + f["n_val"]))
    a.longest = int(lens.max())
    a.train_lens = [int(x) for x in lens[: a.n_train]]
    # Plain: the same training tokens as version 2 (and the validation split's as its validation split).
    tk = {k: v for k, v in f["metadata"]["tokenizer"].items() if k != "files"}
    wr = st.TokenFileWriter(a.plain_tok, f["vocab_size"], f["bos_id"], f["eos_id"], f["kind"])
    wr.append(np.asarray(f["train"]))
    wr.append(np.asarray(f["val"]))
    n = f["n_train"] + f["n_val"]
    wr.finish((f["n_val"] + 0.5) / n, metadata={"tokenizer": tk, "written_by": "tests/bench/sft.py (the training "
                                                  "split of sft.tok as plain tokens)"}, files=f["files"])
    g = st.read_token_file(a.plain_tok)
    if g["version"] != 2 or not np.array_equal(np.asarray(g["train"]), np.asarray(f["train"])) \
            or g["n_val"] != f["n_val"]:
        sys.exit(f"sft.py: {a.plain_tok} does not hold {a.sft_tok}'s training tokens")
    a.hf, a.base = os.path.join(w, "hf"), os.path.join(w, "base.h5")
    a.config = os.path.join(a.hf, "config.json")
    check([a.python, os.path.abspath(__file__), "--make-model", a.hf, a.tokenizer], os.path.join(w, "model.log"),
          "making the model")
    a.params = int(re.search(r"(\d+) parameters", open(os.path.join(w, "model.log")).read()).group(1))
    if os.path.exists(a.base):  # an earlier bench's (import never overwrites a checkpoint)
        os.remove(a.base)
    check(["mpirun", "-np", "1", a.run_bin, "--mode", "import", "--hf-dir", a.hf, "--out", a.base],
          os.path.join(w, "import.log"), "shardtrain --mode import")
    # The rows the training conversations pack into (best-fit, seq-len SEQ_LEN), for part 2's packed batch.
    plan_log = os.path.join(w, "plan.log")
    check([a.run_bin, "--mode", "plan", "--model", a.config, "--data", a.sft_tok, "--seq-len", str(SEQ_LEN),
           "--global-batch", "1", "--steps", "1"], plan_log, "shardtrain --mode plan")
    m = re.search(r"data: (\d+) training examples, (\d+) in (\d+) rows of", open(plan_log).read())
    if not m or int(m.group(2)) != a.n_train:
        sys.exit(f"sft.py: no packing line with {a.n_train} examples in {plan_log}")
    a.rows = int(m.group(3))


def environment(a, results):
    def sh(cmd, env=None):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=300, env=env).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "cpu": sh("lscpu | sed -n 's/^Model name: *//p'"), "cores": os.cpu_count(),
           "loadavg_end": open("/proc/loadavg").read().split()[:3]}
    logs = [r["log"] for r in results if r["program"] != "trl" and r["rc"] == 0]
    env["shardtrain_blas"] = blas_line(open(logs[0]).read()) if logs else "unknown (no shardtrain run succeeded)"
    peaks = []
    for lg in logs:
        m = re.search(r"(?m)^CPU peak \(measured: .*?\): .*= ([0-9.]+) GFLOP/s$", open(lg).read()) or \
            re.search(r"(?m)^CPU peak \(measured: .*?\): \d+ x ([0-9.]+) GFLOP/s", open(lg).read())
        if m:
            peaks.append(float(m.group(1)))
    env["shardtrain_peak_gflops"] = peaks
    # torch's BLAS: MKL's own description of the code path it dispatched (MKL_VERBOSE's first line).
    probe = ("import torch; torch.set_num_threads(%d); a = torch.randn(256, 256); (a @ a).sum(); "
             "import re; c = torch.__config__.show(); "
             "print('CAP', re.search(r'CPU capability usage: (\\S+)', c).group(1), torch.__version__, torch.get_num_threads())"
             % THREADS)
    e = dict(os.environ, MKL_VERBOSE="1", OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))
    out = sh(f"{a.python} -c \"{probe}\" 2>&1", env=e)
    mkl = next((x[len("MKL_VERBOSE "):] for x in out.splitlines() if x.startswith("MKL_VERBOSE oneMKL")
                or x.startswith("MKL_VERBOSE Intel")), "")
    gemm = next((x for x in out.splitlines() if "SGEMM" in x), "")
    cap = next((x.split() for x in out.splitlines() if x.startswith("CAP ")), ["CAP", "?", "?", "?"])
    env["torch"] = f"PyTorch {cap[2]}, CPU capability {cap[1]}, torch.get_num_threads() {cap[3]}"
    env["torch_blas"] = (mkl + (" (MKL_VERBOSE; an fp32 matmul runs " + gemm.split("(")[0].split()[-1] + ")" if gemm
                                else "")) or "unknown (no MKL_VERBOSE line)"
    trl = [r for r in results if r["program"] == "trl" and r["rc"] == 0]
    if trl:
        env["trl_versions"] = trl[0]["versions"]
        env["trl_threads"] = trl[0]["torch_threads"]
        env["trl_attn"] = trl[0]["attn"]
    env["mpirun"] = sh("mpirun --version | head -1")
    return env


# ---- figures ----
def conv_tokens(a, r):
    """Conversation tokens (not padding) a shardtrain run of part 2 trained on, and whether exact."""
    rows = r["positions"] // SEQ_LEN
    if r["program"] == "none":  # --pack none --shuffle off: row j is training example j mod N, untruncated
        full, part = divmod(rows, a.n_train)
        return full * a.train_tokens + sum(a.train_lens[:part]), True
    R = r.get("rows") or a.rows
    return a.train_tokens * rows / R, rows % R == 0


def part2_rate(a, r):
    if r["program"] == "trl":
        return r["conv_tokens"] / r["train_s"]
    return conv_tokens(a, r)[0] / r["train_s"]


def per_round(results, num, den, rate):
    ok = {(r["program"], r["round"]): r for r in results if r["rc"] == 0}
    return [rate(ok[(num, k)]) / rate(ok[(den, k)]) for (p, k) in sorted(ok) if p == num and (den, k) in ok]


def span(xs, f="{:.2f}"):
    return "—" if not xs else (f.format(min(xs)) if len(xs) == 1 else f"{f.format(min(xs))} – {f.format(max(xs))}")


def describe(a, r):
    if r["rc"] != 0:
        return f"{r['program']:7} round {r['round']}: FAILED (exit {r['rc']}), see {r['log']}\n{r.get('error', '')}"
    s = f"{r['program']:7} round {r['round']}: "
    if r["program"] in ("sft", "plain"):
        s += f"{r['done_tok_s']:7.0f} tok/s (done line, positions), {r['train_s']:5.1f} s of training"
    else:
        n = r["conv_tokens"] if r["program"] == "trl" else conv_tokens(a, r)[0]
        s += (f"{part2_rate(a, r):7.0f} conversation tok/s ({n:,.0f} tokens in {r['train_s']:.1f} s of training; "
              f"{r['positions']:,} positions)")
    s += (f"; CPU {r['window_cpu_s']:.1f} s in the window, {r['cpu_s']:.1f} s whole run; wall {r['wall_s']:.1f} s"
          + (f"; peak RSS {r['rss_mib']:.0f} MiB" if "rss_mib" in r else "")
          + (f"; set-up {r['setup_s']:.1f} s" if "setup_s" in r else "")
          + f"; loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    return s


def markdown(a, results, env, cmdline):
    ok = [r for r in results if r["rc"] == 0]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    L = [f"## Issue 55: fine-tuning on chat data (SFT), {env['date']}", ""]
    if a.quick:
        L += ["**QUICK SMOKE RUN (every run 2 steps): not a benchmark.**", ""]
    L += [f"`{cmdline}` (make bench, part 8): {a.rounds} round(s), the programs of each part interleaved in every "
          f"round. Machine: {env['cpu']}, {env['cores']} cores (`lscpu`, `nproc`), shared (load average "
          f"{' '.join(env['loadavg_end'])} at the end); {env['mpirun']}.",
          f"shardtrain's BLAS: {env['shardtrain_blas']}; CPU peak measured at start-up "
          f"{span(env['shardtrain_peak_gflops'], '{:.0f}')} GFLOP/s over the runs. PyTorch's: {env['torch_blas']}. "
          f"{env['torch']}" + (f"; TRL {env['trl_versions']['trl']}, transformers {env['trl_versions']['transformers']}, "
                               f"torch threads in the TRL runs {env['trl_threads']}, attention {env['trl_attn']}"
                               if "trl_versions" in env else "") + ".",
          f"Model: random Llama, hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, "
          f"{MODEL['num_attention_heads']} heads over {MODEL['num_key_value_heads']} KV heads, SwiGLU "
          f"{MODEL['intermediate_size']}, untied, vocabulary 600 ({a.params / 1e6:.2f}M parameters), fp32, imported "
          f"into shardtrain from the same safetensors TRL loads. Data: chat_make.py's 50 conversations x {REPEAT} "
          f"(ChatML with generation markers), `tokenize_hf.py` ({a.tokenize_s:.1f} s): {a.n_train} training conversations,"
          f" {a.train_tokens:,} tokens, the longest {a.longest}; packed into {a.rows} rows of {SEQ_LEN}. Every run: one "
          f"process, {THREADS} threads, AdamW lr 1e-3 constant, beta2 0.95, no weight decay, clip 1.0.", ""]
    # Part 1
    L += [f"Part 1: SFT (the v3 file, default packing, document mask, loss on the assistant tokens) against plain "
          f"training (a v2 file of the same training tokens, causal mask), seq-len {SEQ_LEN}, global batch {P1_BATCH} "
          f"rows, {a.p1_steps} steps; tokens/s from shardtrain's `done:` line (positions, padding included).", "",
          "| round | program | tokens/s | training, s | CPU-s in the window | CPU-s, whole run | wall, s | tokens in rows |",
          "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted([r for r in ok if r["program"] in ("sft", "plain")], key=lambda r: (r["round"], r["program"] != "sft")):
        L.append(f"| {r['round']} | {r['program']} | {r['done_tok_s']:,.0f} | {r['train_s']:.1f} | {r['window_cpu_s']:.1f} "
                 f"| {r['cpu_s']:.1f} | {r['wall_s']:.1f} | {100 * r['fill']:.1f}% |" if "fill" in r else
                 f"| {r['round']} | {r['program']} | {r['done_tok_s']:,.0f} | {r['train_s']:.1f} | {r['window_cpu_s']:.1f} "
                 f"| {r['cpu_s']:.1f} | {r['wall_s']:.1f} | 100% |")
    # Part 2
    L += ["", f"Part 2: shardtrain against TRL's SFTTrainer (assistant_only_loss=True, packing=False), "
          f"{a.n_train} conversations, {a.p2_steps} optimizer steps of {TRL_BATCH * TRL_ACCUM} conversations "
          f"({TRL_BATCH} x {TRL_ACCUM} accumulation; --pack none: {TRL_BATCH} rows x {TRL_ACCUM}; packed: "
          f"{a.packed_batch} rows a step in one micro-batch; packed-mb1: in micro-batches of {a.packed_micro}); "
          "conversation tokens (not padding) per second of training time (step 1 to the last step's end; start-up, "
          "model load, tokenizing and the final evaluation excluded). Positions: what each computed, padding "
          "included.", "",
          "| round | program | conversation tok/s | conversation tokens | positions | training, s | CPU-s in the window "
          "| CPU-s, whole run | wall, s | set-up before training, s | peak RSS, MiB |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = {"trl": 0, "packed": 1, "packed-mb1": 2, "none": 3}
    for r in sorted([r for r in ok if r["program"] in order], key=lambda r: (r["round"], order[r["program"]])):
        n, exact = (r["conv_tokens"], True) if r["program"] == "trl" else conv_tokens(a, r)
        name = {"trl": "TRL", "packed": "shardtrain packed", "packed-mb1": f"shardtrain packed, --micro-batch "
                f"{a.packed_micro}", "none": "shardtrain --pack none"}[r["program"]]
        L.append(f"| {r['round']} | {name} | {part2_rate(a, r):,.0f} | {n:,.0f}{'' if exact else ' (est.)'} | "
                 f"{r['positions']:,} | {r['train_s']:.1f} | {r['window_cpu_s']:.1f} | {r['cpu_s']:.1f} | "
                 f"{r['wall_s']:.1f} | {r.get('setup_s', float('nan')):.1f} | {r.get('rss_mib', float('nan')):.0f} |"
                 .replace("| nan |", "| — |"))
    L += ["", "| comparison | ratio per round | min – max | median | target | met (smallest round) |",
          "|---|---|---:|---:|---|---|"]
    cmp = [("sft/plain", "sft", "plain", lambda r: r["done_tok_s"], "tokens/s (positions)"),
           ("packed/trl", "packed", "trl", lambda r: part2_rate(a, r), "conversation tokens/s"),
           ("packed-mb1/trl", "packed-mb1", "trl", lambda r: part2_rate(a, r), "conversation tokens/s"),
           ("none/trl", "none", "trl", lambda r: part2_rate(a, r), "conversation tokens/s")]
    cpu = [("sft/plain", "plain", "sft", lambda r: r["window_cpu_s"] / r["positions"], "CPU-s per position in the window"),
           ("packed/trl", "trl", "packed", lambda r: r["window_cpu_s"] / (r["conv_tokens"] if r["program"] == "trl"
                                                                           else conv_tokens(a, r)[0]),
            "CPU-s per conversation token in the window"),
           ("packed-mb1/trl", "trl", "packed-mb1", lambda r: r["window_cpu_s"] / (r["conv_tokens"] if r["program"] == "trl"
                                                                                   else conv_tokens(a, r)[0]),
            "CPU-s per conversation token in the window"),
           ("none/trl", "trl", "none", lambda r: r["window_cpu_s"] / (r["conv_tokens"] if r["program"] == "trl"
                                                                       else conv_tokens(a, r)[0]),
            "CPU-s per conversation token in the window")]
    a.summary = {}
    for key, num, den, rate, what in cmp:
        rr = per_round(results, num, den, rate)
        t = TARGETS.get(key)
        a.summary[key] = rr
        L.append(f"| {num} / {den}, {what} | {' '.join(f'{x:.2f}' for x in rr)} | {span(rr)} | {med(rr):.2f} | "
                 + (f"≥ {t} | {'—' if not rr else ('yes' if min(rr) >= t else 'no')} |" if t else "— | — |"))
    for key, num, den, rate, what in cpu:
        rr = per_round(results, num, den, rate)
        a.summary[key + " cpu"] = rr
        L.append(f"| {den} / {num}, {what} ({num} / {den}) | {' '.join(f'{x:.2f}' for x in rr)} | {span(rr)} | "
                 f"{med(rr):.2f} | — | — |")
    trl = {r["round"]: r for r in ok if r["program"] == "trl"}
    none = {r["round"]: r for r in ok if r["program"] == "none"}
    diffs = [max(abs(x - y) / abs(y) for x, y in zip(none[k]["losses"], trl[k]["losses"]))
             for k in trl if k in none and len(none[k]["losses"]) == len(trl[k]["losses"])]
    a.loss_diff = max(diffs) if diffs else None
    L += ["", "Ratios are per round (the two runs of the same round), min – max over rounds; CPU rows: the other "
          "program's CPU seconds per token over shardtrain's (above 1: shardtrain uses less)."
          + (f" Same work: TRL's and shardtrain --pack none's {a.p2_steps} step losses (the same weights and batches in "
             f"the same order) agree within {a.loss_diff:.1e} relative." if a.loss_diff is not None else "")]
    return "\n".join(L) + "\n"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        return trl_worker(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--make-model":
        return make_model(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default="build/shardtrain")
    p.add_argument("--python", default=sys.executable, help="the Python with torch, transformers and trl")
    p.add_argument("--out", default="build/bench")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    cmdline = "python " + os.path.relpath(os.path.abspath(__file__)) + " " + " ".join(sys.argv[1:])
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    os.environ.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    a.work = os.path.join(a.out, "sft")
    os.makedirs(a.work, exist_ok=True)
    real = os.path.realpath(a.bin)
    if not (os.path.isfile(real) and os.access(real, os.X_OK)):
        sys.exit(f"sft.py: --bin '{a.bin}': not an executable file")
    a.run_bin = os.path.abspath(os.path.join(a.work, "shardtrain"))
    shutil.copy2(real, a.run_bin)  # one binary for every round, whatever happens to --bin meanwhile
    t0 = time.perf_counter()
    prepare(a)
    if a.n_train % (TRL_BATCH * TRL_ACCUM):
        sys.exit(f"sft.py: {a.n_train} training conversations are not whole steps of {TRL_BATCH * TRL_ACCUM}")
    a.p1_steps = 2 if a.quick else P1_STEPS
    a.p2_steps = 2 if a.quick else a.n_train // (TRL_BATCH * TRL_ACCUM)  # one epoch
    a.packed_batch = max(1, round(a.rows * TRL_BATCH * TRL_ACCUM / a.n_train))
    a.packed_micro = a.packed_batch // TRL_ACCUM if a.packed_batch % TRL_ACCUM == 0 else a.packed_batch
    print(f"sft.py: {a.n_train} training conversations ({a.train_tokens:,} tokens, longest {a.longest}) in {a.rows} rows "
          f"of {SEQ_LEN}; part 2: {a.p2_steps} steps of {TRL_BATCH}x{TRL_ACCUM} conversations, packed {a.packed_batch} "
          f"rows (packed-mb1: micro-batch {a.packed_micro}); set-up {time.perf_counter() - t0:.0f} s", flush=True)
    results = []
    for rnd in range(1, a.rounds + 1):  # part 1
        for name, data, extra in (("sft", a.sft_tok, []), ("plain", a.plain_tok, [])):
            r = shardtrain_run(a, name, rnd, data, extra + ["--global-batch", str(P1_BATCH)], a.p1_steps)
            results.append(r)
            print(describe(a, r), flush=True)
    for rnd in range(1, a.rounds + 1):  # part 2
        r = trl_run(a, rnd, a.p2_steps)
        results.append(r)
        print(describe(a, r), flush=True)
        for name, extra in (("packed", ["--global-batch", str(a.packed_batch)]),
                            ("packed-mb1", ["--global-batch", str(a.packed_batch), "--micro-batch", str(a.packed_micro)]),
                            ("none", ["--pack", "none", "--shuffle", "off", "--global-batch",
                                      str(TRL_BATCH * TRL_ACCUM), "--micro-batch", str(TRL_BATCH)])):
            r = shardtrain_run(a, name, rnd, a.sft_tok, extra, a.p2_steps)
            results.append(r)
            print(describe(a, r), flush=True)
    env = environment(a, results)
    md = markdown(a, results, env, cmdline)
    print("\n" + md)
    with open(os.path.join(a.out, "sft.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "sft.json"), "w") as f:
        json.dump({"environment": env, "quick": a.quick, "rounds": a.rounds, "summary": a.summary,
                   "loss_diff_trl_none": a.loss_diff, "runs": results}, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'sft.md')} (for docs/benchmarks.md) and sft.json; "
          f"{time.perf_counter() - t0:.0f} s in all")
    return 1 if any(r["rc"] != 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
