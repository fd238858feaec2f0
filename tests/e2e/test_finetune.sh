#!/usr/bin/env bash
# Fine-tuning a Hugging Face Llama end to end (issue 14, item 6), nothing downloaded: transformers
# makes a small Llama with random weights and a SentencePiece tokenizer trained in the test
# (finetune_make.py). Then: --mode import (the tokenizer travels into the checkpoint) -> --mode
# prepare with that model's tokenizer -> train with --init-from at 2 ranks -> export. Asserted:
#   * the token file's ids are AutoTokenizer's on the export, document by document (+ EOS);
#   * the export's tokenizer files are the original's, byte for byte;
#   * transformers' greedy generation from the export equals --mode generate greedy, 32 tokens;
#   * the fine-tuned model really changed (training loss went down from the imported weights);
#   * data made with another tokenizer than the model's is refused, as are --data files of two
#     tokenizers and an import whose tokenizer has more ids than config.json's vocab_size.
source "$(dirname "$0")/common.sh"
"$PY" "$ROOT/tests/e2e/finetune_make.py" "$WORK" >"$WORK/make.log" 2>&1 || { cat "$WORK/make.log"; fail "making the HF Llama"; }
run() {  # name np args...
  local name=$1 np=$2
  shift 2
  timeout -k 5 300 $MPIRUN -np "$np" "$BIN" "$@" >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name"; }
}
run import 2 --mode import --hf-dir "$WORK/hf" --out "$WORK/base.h5"
grep -q "tokenizer: sentencepiece" "$WORK/import.log" || { cat "$WORK/import.log"; fail "import did not take the tokenizer"; }
run prepare 1 --mode prepare --tokenizer "$WORK/hf" --input "$WORK/corpus" --out "$WORK/ft.tok" --val-fraction 0.1
run train 2 --model "$WORK/hf/config.json" --data "$WORK/ft.tok" --init-from "$WORK/base.h5" --seq-len 64 \
  --global-batch 8 --steps 40 --lr 3e-3 --warmup 5 --threads 1 --log-every 1 --checkpoint-dir "$WORK/ck"
run export 1 --mode export "$WORK/ck/step_00000040.h5" --out "$WORK/out"
PROMPT="the king of"
run generate 2 --mode generate "$WORK/ck/step_00000040.h5" --prompt "$PROMPT" --max-new-tokens 32 --temperature 0 --print-ids
"$PY" - "$WORK" "$PROMPT" <<'PY'
import glob, json, re, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
work, prompt = sys.argv[1], sys.argv[2]
out = f"{work}/out"
for f in ["tokenizer.model", "tokenizer.json", "tokenizer_config.json"]:
    assert open(f"{out}/{f}", "rb").read() == open(f"{work}/hf/{f}", "rb").read(), f"{f} differs from the original"
tok = AutoTokenizer.from_pretrained(out)
# Token file (docs/data-format.md): header, then the tokens.
h = np.fromfile(f"{work}/ft.tok", dtype="<u4", count=16)
n_train, n_val, b = int(h[8]) | int(h[9]) << 32, int(h[10]) | int(h[11]) << 32, int(h[6])
ids = np.fromfile(f"{work}/ft.tok", dtype="<u2" if b == 2 else "<u4", count=n_train + n_val, offset=64).tolist()
want = []
for p in sorted(glob.glob(f"{work}/corpus/*.txt")):
    want += tok.encode(open(p, encoding="utf-8").read()) + [tok.eos_token_id]
assert ids == want, f"token file ids differ from AutoTokenizer's on the export ({len(ids)} vs {len(want)} ids)"
print(f"ok: {len(ids)} ids of {len(glob.glob(f'{work}/corpus/*.txt'))} documents equal AutoTokenizer's on the export")
model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
x = tok(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    g = model.generate(x, do_sample=False, max_new_tokens=32, pad_token_id=tok.eos_token_id)[0, x.shape[1]:].tolist()
if tok.eos_token_id in g:
    g = g[: g.index(tok.eos_token_id)]
log = open(f"{work}/generate.log").read()
m = re.search(r"generate: prompt ids: ([0-9,]+)", log)
assert m and [int(v) for v in m.group(1).split(",")] == x[0].tolist(), f"prompt ids differ: {m and m.group(1)} vs {x[0].tolist()}"
m = re.search(r"generate: new ids: ([0-9,]*)", log)
ours = [int(v) for v in m.group(1).split(",") if v] if m else None
assert ours == g, f"greedy generation differs:\n shardtrain   {ours}\n transformers {g}"
print(f"ok: greedy generation of {len(g)} tokens equals transformers' ({tok.decode(g)!r})")
PY
"$PY" - "$WORK/train.log" <<'PY'
import re, sys
loss = [float(m) for m in re.findall(r"^step \d+/\d+ .*?loss ([0-9.]+)", open(sys.argv[1]).read(), re.M)]
assert len(loss) >= 40 and sum(loss[-5:]) / 5 < loss[0] - 0.3, f"fine-tuning did not lower the loss: {loss[:3]} ... {loss[-3:]}"
print(f"ok: fine-tuning loss {loss[0]:.3f} -> {sum(loss[-5:]) / 5:.3f}")
PY
# Data made with another SentencePiece model than the imported one: every id would mean another
# token; refused on every rank, naming both files.
run other_tok 1 --mode tokenizer --input "$WORK/corpus" --vocab-size 320 --out "$WORK/other.model"
run other_prep 1 --mode prepare --tokenizer "$WORK/other.model" --input "$WORK/corpus" --out "$WORK/other.tok"
expect_fail other_tokenizer "was made with another tokenizer (sentencepiece) than the model of checkpoint" 2 \
  --model "$WORK/hf/config.json" --data "$WORK/other.tok" --init-from "$WORK/base.h5" --seq-len 64 --global-batch 8 \
  --steps 2 --threads 1
# Two token files of the same size and kind but different SentencePiece models: one dataset, one tokenizer.
expect_fail mixed_data "were made with different tokenizers (their embedded tokenizer.model differ)" 2 \
  --model "$WORK/hf/config.json" --data "$WORK/ft.tok" --data "$WORK/other.tok" --seq-len 64 --global-batch 8 \
  --steps 2 --threads 1
# A tokenizer with more ids than the model's vocabulary is refused at import, naming both.
cp -r "$WORK/hf" "$WORK/hf_small"
"$PY" -c 'import json,sys; p=sys.argv[1]; c=json.load(open(p)); c["vocab_size"]=300; json.dump(c,open(p,"w"))' "$WORK/hf_small/config.json"
expect_fail import_vocab "its tokenizer (tokenizer.model) has ids up to 319, beyond the vocab_size 300 of config.json" 2 \
  --mode import --hf-dir "$WORK/hf_small" --out "$WORK/small.h5"
[ ! -e "$WORK/small.h5" ] || fail "a refused import left a checkpoint"
echo "ok: fine-tune round trip"
