#!/usr/bin/env bash
# scripts/tokenize_hf.py against independent references (tests/e2e/tokenize_hf_check.py): a GPT-2-like
# byte-level BPE (no BOS, u16), a Llama-3-like one (BOS, vocabulary > 65536, u32) and an AutoTokenizer
# directory, all trained here; text files and JSONL with non-ASCII, whitespace runs, empty documents;
# --workers 1 and 3 give identical files; the error cases exit non-zero naming the file.
# Needs only the venv (make venv), not the shardtrain binary; $1 (the build dir) is unused.
source "$(dirname "$0")/common.sh"
[ -x "$PY" ] || fail "no venv at $ROOT/.venv (make venv)"
TOK="$PY $ROOT/scripts/tokenize_hf.py --quiet"
CHECK="$PY $ROOT/tests/e2e/tokenize_hf_check.py"
cd "$WORK"
$CHECK make "$WORK"
IN=(corpus/doc0.txt corpus/doc1.txt corpus/doc2.txt corpus/doc3.txt corpus/doc4.txt corpus/doc5.txt corpus/docs.jsonl)

for k in gpt2 llama3; do
  $TOK --tokenizer $k/tokenizer.json --out $k-w1.tok --workers 1 "${IN[@]}" >/dev/null 2>&1 || fail "$k: workers 1"
  # A directory input (files in name order: the same list), small batches so 3 workers interleave.
  $TOK --tokenizer $k/tokenizer.json --out $k-w3.tok --workers 3 --batch-docs 3 corpus >/dev/null 2>&1 || fail "$k: workers 3"
  cmp -s $k-w1.tok $k-w3.tok || fail "$k: --workers 1 and 3 differ"
  $CHECK check "$WORK" $k-w1.tok $k "${IN[@]}"
  echo "ok: $k: --workers 1 and --workers 3 (directory input) identical"
done
$TOK --tokenizer auto --out auto.tok --workers 2 'corpus/doc*' >/dev/null 2>&1 || fail "auto: glob input"
$CHECK check "$WORK" auto.tok auto "${IN[@]}"

# --eos-id: a tokenizer without EOS needs one.
$TOK --tokenizer noeos/tokenizer.json --out noeos.tok --workers 1 --eos-id 5 corpus/doc0.txt >/dev/null 2>&1 || fail "--eos-id"
"$PY" - <<EOF || fail "--eos-id: wrong file"
import sys; sys.path.insert(0, "$ROOT/scripts")
import shardtrain_tokens as st
t = st.read_token_file("noeos.tok")
assert t["eos_id"] == 5 and t["bos_id"] is None and int(t["val"][-1]) == 5, (t["eos_id"], t["bos_id"])
EOF
echo "ok: --eos-id 5 with a tokenizer without EOS"

# refuse NAME WANT ARGS...: tokenize_hf.py exits 1, prints WANT, leaves no output or temporary file.
refuse() {
  local name=$1 want=$2 rc=0
  shift 2
  rm -f out.tok .out.tok.*
  $TOK "$@" >"$name.log" 2>&1 || rc=$?
  [ "$rc" -eq 1 ] || { cat "$name.log"; fail "$name: exit status $rc, expected 1"; }
  grep -qF -- "$want" "$name.log" || { cat "$name.log"; fail "$name: output lacks '$want'"; }
  ! ls out.tok .out.tok.* >/dev/null 2>&1 || fail "$name: left an output file behind"
  echo "ok: $name -> $(grep -m1 error "$name.log" | cut -c1-150)"
}
printf '{"text": "fine"}\n{"text": "broken\n' >bad.jsonl
printf '{"text": "fine"}\n{"body": "no text field"}\n' >nofield.jsonl
printf '\xff\xfe not UTF-8\n' >latin.txt
mkdir -p outdir
refuse missing-input "input 'corpus/nope.txt': no such file" --tokenizer gpt2/tokenizer.json --out out.tok corpus/nope.txt
refuse glob-no-match "input 'corpus/*.none': the pattern matches no file" --tokenizer gpt2/tokenizer.json --out out.tok 'corpus/*.none'
refuse bad-jsonl "bad.jsonl:2: not a JSON line" --tokenizer gpt2/tokenizer.json --out out.tok --workers 2 corpus/doc0.txt bad.jsonl
refuse no-field "nofield.jsonl:2: no field 'text'" --tokenizer gpt2/tokenizer.json --out out.tok nofield.jsonl
refuse not-utf8 "latin.txt: not UTF-8 text" --tokenizer gpt2/tokenizer.json --out out.tok latin.txt
refuse bad-tokenizer "tokenizer 'corpus/doc0.txt': not a loadable tokenizer.json" --tokenizer corpus/doc0.txt --out out.tok corpus/doc1.txt
refuse missing-tokenizer "tokenizer 'nope/tokenizer.json': no such file" --tokenizer nope/tokenizer.json --out out.tok corpus/doc1.txt
refuse bad-tokenizer-dir "tokenizer 'outdir': AutoTokenizer cannot load it" --tokenizer outdir --out out.tok corpus/doc1.txt
refuse no-eos "tokenizer 'noeos/tokenizer.json' has no EOS token" --tokenizer noeos/tokenizer.json --out out.tok corpus/doc1.txt
refuse out-is-dir "output 'outdir' is a directory" --tokenizer gpt2/tokenizer.json --out outdir corpus/doc1.txt
refuse out-is-input "output 'corpus/doc1.txt' is also an input" --tokenizer gpt2/tokenizer.json --out corpus/doc1.txt corpus
$CHECK check "$WORK" gpt2-w1.tok gpt2 "${IN[@]}" >/dev/null || fail "inputs changed by the refused runs"
# shardtrain trains on these files and its export carries the tokenizer: AutoTokenizer on the
# export gives the token file's ids, document by document (GPT-2-like: no BOS, u16; Llama-3-like:
# BOS, ids above 65,535 as u32), and the tokenizer.json comes back byte for byte.
for k in gpt2 llama3; do
  V=$("$PY" -c "import sys; sys.path.insert(0, '$ROOT/scripts'); import shardtrain_tokens as st; print(st.read_token_file('$k-w1.tok')['vocab_size'])")
  printf '{"vocab_size": %d, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": true}\n' \
    "$V" >"$k-model.json"
  timeout -k 5 300 $MPIRUN -np 2 "$BIN" --model "$k-model.json" --data "$k-w1.tok" --seq-len 16 --global-batch 4 --steps 2 \
    --threads 1 --eval-batches 1 --checkpoint-dir "ck-$k" >"$k-train.log" 2>&1 || { cat "$k-train.log"; fail "$k: train"; }
  timeout -k 5 120 "$BIN" --mode export "ck-$k/step_00000002.h5" --out "hf-$k" >"$k-export.log" 2>&1 ||
    { cat "$k-export.log"; fail "$k: export"; }
  grep -q "tokenizer: hf-tokenizers" "$k-export.log" || { cat "$k-export.log"; fail "$k: export wrote no tokenizer"; }
  "$PY" - "$k" "${IN[@]}" <<'PY' || fail "$k: AutoTokenizer on the export"
import json, sys
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
k, inputs = sys.argv[1], sys.argv[2:]
import numpy as np
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(f"hf-{k}")
assert open(f"hf-{k}/tokenizer.json", "rb").read() == open(f"{k}/tokenizer.json", "rb").read(), "tokenizer.json differs"
h = np.fromfile(f"{k}-w1.tok", dtype="<u4", count=16)
n = (int(h[8]) | int(h[9]) << 32) + (int(h[10]) | int(h[11]) << 32)
ids = np.fromfile(f"{k}-w1.tok", dtype="<u2" if int(h[6]) == 2 else "<u4", count=n, offset=64).tolist()
gen = json.load(open(f"hf-{k}/generation_config.json"))
docs = []
for p in inputs:
    if p.endswith(".jsonl"):
        docs += [json.loads(l)["text"] for l in open(p, encoding="utf-8") if l.strip()]
    else:
        docs.append(open(p, encoding="utf-8").read())
want = []
for d in docs:  # AutoTokenizer's own framing: BOS where the tokenizer has one, then EOS
    want += tok.encode(d) + [tok.eos_token_id]
assert ids == want, f"ids differ from AutoTokenizer's on the export ({len(ids)} vs {len(want)})"
assert gen["eos_token_id"] == tok.eos_token_id, (gen, tok.eos_token_id)
print(f"ok: {k}: trained, exported; AutoTokenizer on the export gives the file's {len(ids)} ids "
      f"(max id {max(ids)}), tokenizer.json byte for byte")
PY
done
echo "PASS"
