#!/usr/bin/env python3
"""make bench, part 5: tokenizing throughput of `--mode prepare` beside the Python peers.

On the same corpus (the text file given, copied into COPIES documents), with the same SentencePiece
BPE model (trained by `shardtrain --mode tokenizer` on that text), each run encodes every document,
frames it (BOS ... EOS) and writes the ids to a file:

  shardtrain     BIN --mode prepare --tokenizer MODEL --input DIR   (libsentencepiece, C++)
  sentencepiece  Python sentencepiece's SentencePieceProcessor.encode on the list of documents
  tokenizers     Hugging Face tokenizers' Tokenizer.encode_batch with the same model converted by
                 transformers (tokenizer.json)

Runs are interleaved (A B C, A B C, ...) over ROUNDS rounds; each reports wall seconds, the
CPU-seconds of its process tree (the machine is shared and noisy) and MB/s of input text; the best
round counts. All three must give the same ids (checked). Then a byte-level run on a large corpus
(LARGE_MB) and a small one report peak RSS: prepare streams in constant memory.

  python3 tests/bench/prepare.py BIN TEXT OUTDIR [--quick]

Writes OUTDIR/prepare.md (markdown for docs/benchmarks.md) and prints it.
"""
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time

BIN, TEXT, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
QUICK = "--quick" in sys.argv
PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".venv", "bin", "python")
COPIES = 2 if QUICK else 16
ROUNDS = 1 if QUICK else 3
LARGE_MB = 64 if QUICK else 2048
VOCAB = 4096
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_btl_vader_single_copy_mechanism="none")
W = os.path.join(OUT, "prepare")
shutil.rmtree(W, ignore_errors=True)
os.makedirs(os.path.join(W, "corpus"))
text = open(TEXT, encoding="utf-8").read()
for i in range(COPIES):  # the same text, COPIES documents
    with open(os.path.join(W, "corpus", f"doc{i:03d}.txt"), "w", encoding="utf-8") as f:
        f.write(text)
in_bytes = COPIES * len(text.encode("utf-8"))


def timed(cmd, **kw):
    """Runs cmd; returns (wall s, CPU-seconds of the children, stdout+stderr)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, **kw)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"prepare bench: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), p.stdout + p.stderr


model = os.path.join(W, "sp.model")
t_train, c_train, _ = timed([BIN, "--mode", "tokenizer", "--input", TEXT, "--vocab-size", str(VOCAB), "--out", model])
# The same model as transformers converts it (tokenizer.json), for the tokenizers peer.
hf = os.path.join(W, "hf")
conv = f"""
import os, shutil, json, sys
import sentencepiece as spm
from transformers import AutoTokenizer
hf, model = sys.argv[1], sys.argv[2]
os.makedirs(hf, exist_ok=True); shutil.copy(model, hf + "/tokenizer.model")
sp = spm.SentencePieceProcessor(model_file=model)
prefix = sp.encode_as_pieces("a")[0].startswith("\\u2581")
json.dump({{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "legacy": False, "add_prefix_space": prefix}}, open(hf + "/tokenizer_config.json", "w"))
AutoTokenizer.from_pretrained(hf).save_pretrained(hf)
"""
subprocess.run([PY, "-c", conv, hf, model], check=True, env=ENV, capture_output=True)

PEER = r"""
import glob, sys, time
import numpy as np
kind, src, corpus, out = sys.argv[1:5]
docs = [open(p, encoding="utf-8").read() for p in sorted(glob.glob(corpus + "/*.txt"))]
if kind == "sentencepiece":
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=src)
    ids, bos, eos = sp.encode(docs), sp.bos_id(), sp.eos_id()
else:
    from tokenizers import Tokenizer
    tk = Tokenizer.from_file(src + "/tokenizer.json")
    ids = [e.ids for e in tk.encode_batch(docs, add_special_tokens=False)]
    bos, eos = tk.token_to_id("<s>"), tk.token_to_id("</s>")
flat = []
for d in ids:
    flat += [bos] + d + [eos]
np.asarray(flat, dtype="<u2").tofile(out)
"""
runs = {
    "shardtrain": lambda o: [BIN, "--mode", "prepare", "--tokenizer", model, "--input", os.path.join(W, "corpus"),
                             "--out", o],
    "sentencepiece": lambda o: [PY, "-c", PEER, "sentencepiece", model, os.path.join(W, "corpus"), o],
    "tokenizers": lambda o: [PY, "-c", PEER, "tokenizers", hf, os.path.join(W, "corpus"), o],
}
best = {}
for r in range(ROUNDS):
    for name, cmd in runs.items():
        o = os.path.join(W, f"{name}.ids")
        wall, cpu, _ = timed(cmd(o))
        print(f"round {r + 1} {name}: {wall:.2f} s wall, {cpu:.2f} CPU-s, {in_bytes / wall / 1e6:.2f} MB/s", flush=True)
        if name not in best or wall < best[name][0]:
            best[name] = (wall, cpu)


def read_ids(path, name):
    import numpy as np
    if name != "shardtrain":
        return np.fromfile(path, dtype="<u2")
    h = np.fromfile(path, dtype="<u4", count=16)
    n = (int(h[8]) | int(h[9]) << 32) + (int(h[10]) | int(h[11]) << 32)
    return np.fromfile(path, dtype="<u2" if int(h[6]) == 2 else "<u4", count=n, offset=64)


ref = read_ids(os.path.join(W, "shardtrain.ids"), "shardtrain")
same = {n: bool((read_ids(os.path.join(W, f"{n}.ids"), n) == ref).all()) if
        len(read_ids(os.path.join(W, f"{n}.ids"), n)) == len(ref) else False for n in runs}


def rss_run(mb):  # byte-level prepare of mb MB of text in 64 files; returns (wall, peak RSS MiB)
    d = os.path.join(W, f"big{mb}")
    os.makedirs(d, exist_ok=True)
    chunk = (text * (1 + (1 << 20) // len(text)))[: 1 << 20]
    per = max(1, mb // 64)
    for i in range(64):
        with open(os.path.join(d, f"part{i:02d}.txt"), "w", encoding="utf-8") as f:
            for _ in range(per):
                f.write(chunk)
    out = os.path.join(W, f"big{mb}.tok")
    wall, _, log = timed([BIN, "--mode", "prepare", "--input", d, "--out", out])
    shutil.rmtree(d)
    os.remove(out)
    m = re.search(r"peak RSS ([0-9.]+) MB", log)  # prepare's own summary line (VmHWM)
    return wall, float(m.group(1)) * 1e6 / 2**20 if m else float("nan"), 64 * per
small = rss_run(64 if not QUICK else 8)
large = rss_run(LARGE_MB)

sw, sc = best["shardtrain"]
lines = [f"Corpus: {os.path.basename(TEXT)} x {COPIES} documents = {in_bytes / 1e6:.1f} MB of text; SentencePiece BPE "
         f"vocab {VOCAB} trained by `--mode tokenizer` on the text ({t_train:.1f} s). Best of {ROUNDS} interleaved rounds.",
         "", "| tokenizer run | wall s | CPU-s | MB/s of text | wall vs shardtrain | same ids |", "|---|---|---|---|---|---|"]
for name in runs:
    w, c = best[name]
    lines.append(f"| {name} | {w:.2f} | {c:.2f} | {in_bytes / w / 1e6:.2f} | {w / sw:.2f}x | {'yes' if same[name] else 'NO'} |")
lines += ["", f"Byte-level `--mode prepare`, peak RSS (VmHWM, from its summary line): {small[2]} MiB of text: {small[1]:.0f} MiB "
          f"({small[0]:.1f} s); {large[2]} MiB of text: {large[1]:.0f} MiB ({large[0]:.1f} s, "
          f"{large[2] / large[0]:.0f} MiB/s)."]
md = "\n".join(lines) + "\n"
open(os.path.join(OUT, "prepare.md"), "w").write(md)
print(md)
if not all(same.values()):
    sys.exit("prepare bench: the tokenizers disagree on the ids (see the table)")
