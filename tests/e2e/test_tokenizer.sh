#!/usr/bin/env bash
# Tokenizers (issue 14): --mode tokenizer trains a SentencePiece model; --mode prepare writes a
# version-2 token file whose ids equal independent references: Python sentencepiece for every
# document framed BOS + ids + EOS, transformers' AutoTokenizer / LlamaTokenizer, the UTF-8 bytes
# for byte-level; the embedded tokenizer.model equals the file byte for byte; documents cut into
# 64-byte chunks give exactly the ids of encoding them whole; bad inputs fail on every rank,
# naming the file or option.
source "$(dirname "$0")/common.sh"
"$PY" "$ROOT/tests/e2e/tokenizer_corpus.py" "$WORK"
DOCS=$WORK/expected_docs.json

# Train (2 ranks: rank 0 trains, both agree) a 500-piece model on the generated corpus.
$MPIRUN -np 2 "$BIN" --mode tokenizer --input "$WORK/train.txt" --vocab-size 500 --out "$WORK/tok.model" >"$WORK/train.log" 2>&1 \
  || { cat "$WORK/train.log"; fail "--mode tokenizer"; }
grep -m1 "tokenizer: wrote" "$WORK/train.log"
mkdir -p "$WORK/hf" && cp "$WORK/tok.model" "$WORK/hf/tokenizer.model"

# Ids: the documents (plain-text files, a .jsonl with empty documents), whole and in 64-byte chunks.
"$BIN" --mode prepare --tokenizer "$WORK/tok.model" --input "$WORK/docs" --out "$WORK/whole.tok" | tail -1
"$PY" "$ROOT/tests/e2e/token_file_check.py" "$WORK/whole.tok" "$DOCS" "$WORK/tok.model" 0.1 "$WORK/hf" 2>&1 | grep -v Warning
SHARDTRAIN_TEST_PREPARE_CHUNK_BYTES=64 $MPIRUN -np 2 -x SHARDTRAIN_TEST_PREPARE_CHUNK_BYTES "$BIN" --mode prepare \
  --tokenizer "$WORK/tok.model" --input "$WORK/docs/*.txt" "$WORK/docs/z.jsonl" --out "$WORK/chunked.tok" | tail -1
"$PY" "$ROOT/tests/e2e/token_file_check.py" "$WORK/chunked.tok" "$DOCS" "$WORK/tok.model" 0.1
cmp "$WORK/whole.tok" "$WORK/chunked.tok" || fail "64-byte chunks changed the token file"
echo "ok: 64-byte chunks give the same file byte for byte"

# A model trained from scratch on this data: its export carries tokenizer.model and a
# tokenizer_config.json of shardtrain's making; AutoTokenizer there (BOS added by itself) must give
# each document's framed ids as the token file holds them, documents with a leading space included.
printf '{"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}\n' >"$WORK/m.json"
$MPIRUN -np 2 "$BIN" --model "$WORK/m.json" --data "$WORK/whole.tok" --seq-len 16 --global-batch 4 --steps 2 --threads 1 \
  --eval-batches 1 --checkpoint-dir "$WORK/ck" >"$WORK/fit.log" 2>&1 || { cat "$WORK/fit.log"; fail "training on the SentencePiece data"; }
"$BIN" --mode export "$WORK/ck/step_00000002.h5" --out "$WORK/exp" >"$WORK/exp.log" 2>&1 || { cat "$WORK/exp.log"; fail "export"; }
"$PY" - "$WORK/exp" "$DOCS" "$WORK/whole.tok" "$WORK/tok.model" 2>"$WORK/exp_check.err" <<'PY' || { cat "$WORK/exp_check.err"; fail "AutoTokenizer on the export"; }
import json, sys
import numpy as np
from transformers import AutoTokenizer
exp, docs_path, tokfile, model = sys.argv[1:5]
assert open(f"{exp}/tokenizer.model", "rb").read() == open(model, "rb").read(), "tokenizer.model differs"
tok = AutoTokenizer.from_pretrained(exp)
docs = json.load(open(docs_path, encoding="utf-8"))
h = np.fromfile(tokfile, dtype="<u4", count=16)
n = (int(h[8]) | int(h[9]) << 32) + (int(h[10]) | int(h[11]) << 32)
ids = np.fromfile(tokfile, dtype="<u2", count=n, offset=64).tolist()
want = []
for d in docs:
    want += tok.encode(d) + [tok.eos_token_id]
assert ids == want, "AutoTokenizer on the export differs from the token file"
lead = sum(1 for d in docs if d.startswith(" "))
print(f"ok: AutoTokenizer ({type(tok).__name__}) on the export gives the token file's {len(ids)} ids of {len(docs)} "
      f"documents ({lead} starting with a space), BOS included by itself")
PY
# Byte-level (the default), chunked too.
SHARDTRAIN_TEST_PREPARE_CHUNK_BYTES=64 "$BIN" --mode prepare --input "$WORK/docs" --out "$WORK/bytes.tok" --val-fraction 0.25 | tail -1
"$PY" "$ROOT/tests/e2e/token_file_check.py" "$WORK/bytes.tok" "$DOCS" byte-level 0.25
# A Hugging Face-style directory: tokenizer.model plus the JSON files, the chat template and
# generation_config.json, all embedded.
echo '{"add_bos_token": true, "add_eos_token": false}' >"$WORK/hf/tokenizer_config.json"
echo '{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}' >"$WORK/hf/special_tokens_map.json"
printf '%s' "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %} café" >"$WORK/hf/chat_template.jinja"
echo '{"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6}' >"$WORK/hf/generation_config.json"
"$BIN" --mode prepare --tokenizer "$WORK/hf" --input "$WORK/docs" --out "$WORK/dir.tok" | tail -1
"$PY" - "$WORK/dir.tok" "$WORK/hf" <<'PY'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
tb, J = struct.unpack_from("<2I", raw, 24)
n = sum(struct.unpack_from("<2Q", raw, 32))
meta = json.loads(raw[64 + tb * n: 64 + tb * n + J])
area = 64 + tb * n + J
for name, f in meta["tokenizer"]["files"].items():
    assert raw[area + f["offset"]: area + f["offset"] + f["bytes"]] == open(f"{sys.argv[2]}/{name}", "rb").read(), name
assert sorted(meta["tokenizer"]["files"]) == ["chat_template.jinja", "generation_config.json", "special_tokens_map.json",
                                              "tokenizer.model", "tokenizer_config.json"], sorted(meta["tokenizer"]["files"])
print("ok: a tokenizer directory embeds", ", ".join(sorted(meta["tokenizer"]["files"])), "byte for byte")
PY

# Bad inputs: every rank exits non-zero, naming the file or option.
printf 'not a model' >"$WORK/bad.model"
printf '{"text": "fine"}\n{"text": broken}\n' >"$WORK/bad.jsonl"
printf '{"body": "no text field"}\n' >"$WORK/nofield.jsonl"
expect_fail missing_input "cannot read input text '$WORK/none.txt' (option '--input')" 2 \
  --mode prepare --tokenizer "$WORK/tok.model" --input "$WORK/none.txt" --out "$WORK/x.tok"
expect_fail bad_model "option '--tokenizer': cannot load tokenizer '$WORK/bad.model'" 2 \
  --mode prepare --tokenizer "$WORK/bad.model" --input "$WORK/docs" --out "$WORK/x.tok"
expect_fail missing_model "option '--tokenizer': cannot load tokenizer '$WORK/none.model': no such file" 2 \
  --mode prepare --tokenizer "$WORK/none.model" --input "$WORK/docs" --out "$WORK/x.tok"
expect_fail bad_jsonl "$WORK/bad.jsonl:2: invalid JSON" 2 --mode prepare --input "$WORK/bad.jsonl" --out "$WORK/x.tok"
expect_fail no_text_field "$WORK/nofield.jsonl:1: no field 'text' (option '--text-field'" 2 \
  --mode prepare --input "$WORK/nofield.jsonl" --out "$WORK/x.tok"
expect_fail vocab_too_small "option '--vocab-size' must be at least 260" 2 \
  --mode tokenizer --input "$WORK/train.txt" --vocab-size 100 --out "$WORK/x.model"
expect_fail vocab_below_chars "option '--vocab-size' 262 does not fit the corpus" 2 \
  --mode tokenizer --input "$WORK/train.txt" --vocab-size 262 --out "$WORK/x.model"
expect_fail tokenizer_missing_input "cannot read input text '$WORK/none.txt' (option '--input')" 2 \
  --mode tokenizer --input "$WORK/none.txt" --vocab-size 500 --out "$WORK/x.model"
expect_fail tokenizer_no_vocab "option '--vocab-size' is required with --mode tokenizer" 2 \
  --mode tokenizer --input "$WORK/train.txt" --out "$WORK/x.model"
expect_fail out_is_input "option '--out': '$WORK/docs/p00.txt' is also an input" 2 \
  --mode prepare --input "$WORK/docs" --out "$WORK/docs/p00.txt"
# Outputs that a rename would destroy: a FIFO (or a device such as /dev/null), the tokenizer
# itself; and an input that is a token file (an earlier --out inside an input directory).
mkfifo "$WORK/fifo"
cp "$WORK/tok.model" "$WORK/tokcopy.model"
expect_fail out_is_fifo "option '--out': '$WORK/fifo' is a FIFO" 2 --mode prepare --input "$WORK/docs" --out "$WORK/fifo"
expect_fail tokenizer_out_is_fifo "option '--out': '$WORK/fifo' is a FIFO" 2 \
  --mode tokenizer --input "$WORK/train.txt" --vocab-size 500 --out "$WORK/fifo"
[ -p "$WORK/fifo" ] || fail "the FIFO was replaced"
expect_fail out_is_tokenizer "option '--out': '$WORK/tokcopy.model' is the tokenizer (option '--tokenizer')" 2 \
  --mode prepare --tokenizer "$WORK/tokcopy.model" --input "$WORK/docs" --out "$WORK/tokcopy.model"
cmp -s "$WORK/tok.model" "$WORK/tokcopy.model" || fail "the tokenizer was overwritten"
mkdir -p "$WORK/withtok" && cp "$WORK/docs/p00.txt" "$WORK/whole.tok" "$WORK/withtok/"
expect_fail input_is_token_file "input '$WORK/withtok/whole.tok' is a shardtrain token file, not text" 2 \
  --mode prepare --input "$WORK/withtok" --out "$WORK/x.tok"
# A tokenizer directory whose generation_config.json names an id outside the model: refused, named.
cp -r "$WORK/hf" "$WORK/hfbad" && echo '{"eos_token_id": [2, 99999]}' >"$WORK/hfbad/generation_config.json"
expect_fail dir_generation_config "option '--tokenizer': '$WORK/hfbad/generation_config.json': key 'eos_token_id' = [2,99999]: id 99999 is outside the vocabulary" 2 \
  --mode prepare --tokenizer "$WORK/hfbad" --input "$WORK/docs" --out "$WORK/x.tok"
[ ! -e "$WORK/x.tok" ] && [ ! -e "$WORK/x.tok.tmp" ] && [ ! -e "$WORK/x.model" ] || fail "a failed run left an output file"
echo "ok: no output or temporary file left by the failed runs"
