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
echo "PASS"
