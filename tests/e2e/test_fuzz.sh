#!/usr/bin/env bash
# Issue 27: model directories, checkpoints, token files, job files and SentencePiece models from
# strangers. tests/e2e/fuzz.py mutates valid seeds made here (by shardtrain itself; the NFKC
# SentencePiece model by Python's sentencepiece) and runs the reader of each: every case must end
# in exit 0 or a clean refusal (exit 1 with a "shardtrain: error" line), never a signal, a hang or
# an allocation beyond the address-space limit. Default: 40 cases per target (8 targets, 320 cases), fixed seed (~2 min on
# 2 cores); FUZZ_CASES=N runs N cases in all, FUZZ_SEED=S other cases; failures are kept under
# $BUILD/fuzz/failures/. One JSON case in ten is aimed at a JSON reader's limits (issue 53).
source "$(dirname "$0")/common.sh"
S=$WORK/seeds
mkdir -p "$S"
head -c 60000 /usr/share/games/fortunes/fortunes >"$S/big.txt"
head -c 4000 /usr/share/games/fortunes/riddles >"$S/text.txt"
"$BIN" --mode prepare --input "$S/text.txt" --out "$S/c.tok" >/dev/null
# llm.c shard (header: 256 int32, magic 20240520, version 1, token count; then u16 ids) and a
# headerless nanoGPT file, both of the text's bytes.
"$PY" - "$S" <<'PY'
import struct, sys
d = sys.argv[1]
ids = list(open(f"{d}/text.txt", "rb").read()[:3000])
hdr = [20240520, 1, len(ids)] + [0] * 253
open(f"{d}/llmc.bin", "wb").write(struct.pack("<256i", *hdr) + struct.pack(f"<{len(ids)}H", *ids))
open(f"{d}/nanogpt.bin", "wb").write(struct.pack(f"<{len(ids)}H", *ids))
PY
# A format version 3 token file (chat data: example starts, role classes) of the same bytes, by the
# script's writer: examples of 100 tokens, roles cycling by example.
"$PY" - "$S" "$ROOT/scripts" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
import shardtrain_tokens as st
d = sys.argv[1]
ids = list(open(f"{d}/text.txt", "rb").read()[:3000])
w = st.TokenFileWriter(f"{d}/chat.tok", 258, 256, 257, "byte-level", examples=True)
for k in range(0, len(ids), 100):
    w.append(ids[k:k + 100], [(k // 100 + i) % 3 for i in range(len(ids[k:k + 100]))])
w.finish(0.1, {"documents": len(ids) // 100}, examples={"source": "chat"})
PY
"$BIN" --mode tokenizer --input "$S/big.txt" --vocab-size 400 --out "$S/sp_identity.model" >/dev/null
"$PY" - "$S" <<'PY'
import sys, sentencepiece as spm
d = sys.argv[1]
spm.SentencePieceTrainer.train(input=f"{d}/big.txt", model_prefix=f"{d}/sp_nfkc", vocab_size=400, model_type="bpe",
                               normalization_rule_name="nmt_nfkc", byte_fallback=True, minloglevel=2)
PY
TRAIN=(--seq-len 16 --global-batch 2 --eval-batches 1 --threads 1)
"$BIN" --model tiny --data "$S/c.tok" "${TRAIN[@]}" --steps 2 --checkpoint-dir "$S/ck" >/dev/null
cp "$S/ck/step_00000002.h5" "$S/ckpt.h5"
"$BIN" --mode export "$S/ckpt.h5" --out "$S/hf_single" >/dev/null
"$BIN" --mode export "$S/ckpt.h5" --out "$S/hf_sharded" --max-shard-size 8KB >/dev/null
[ -f "$S/hf_sharded/model.safetensors.index.json" ] || fail "seed: no sharded export"
# A model whose vocabulary holds the SentencePiece model's 300 ids, with that model (NFKC) as its
# tokenizer.model: a case that imports is then run with a text prompt, which the model encodes.
printf '{"vocab_size": 512, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}\n' >"$S/m.json"
"$BIN" --model "$S/m.json" --data "$S/c.tok" "${TRAIN[@]}" --steps 1 --checkpoint-dir "$S/ck2" >/dev/null
"$BIN" --mode export "$S/ck2/step_00000001.h5" --out "$S/hf_sp" >/dev/null
rm -f "$S/hf_sp/tokenizer.json" "$S/hf_sp/tokenizer_config.json" "$S/hf_sp/special_tokens_map.json"
cp "$S/sp_nfkc.model" "$S/hf_sp/tokenizer.model"
echo "seeds: $(ls "$S" | tr '\n' ' ')"
# Every seed is accepted as it is (the fuzzer's baseline).
"$BIN" --mode import --hf-dir "$S/hf_sp" --out "$WORK/sp.h5" >/dev/null || fail "seed hf_sp does not import"
"$BIN" --mode generate "$WORK/sp.h5" --prompt "Hello" --max-new-tokens 1 >/dev/null || fail "seed hf_sp does not generate"
"$BIN" --mode import --hf-dir "$S/hf_sharded" --out "$WORK/sh.h5" >/dev/null || fail "seed hf_sharded does not import"
printf 'model = tiny\nseq-len = 16\nglobal-batch = 4\nsteps = 10\n' >"$S/job.ini"
"$BIN" --config "$S/job.ini" --mode plan >/dev/null || fail "seed job.ini"
# The harness checks itself first (issue 53): its mutators, many times over these seeds, never raise
# and share no state between cases. Exit status of this test: 1, shardtrain failed a case; 2, the
# harness failed (its self-test, or an error of its own in a case: the other cases still ran);
# 3, both.
harness_error() { echo "FAIL: fuzz harness error (not a shardtrain failure): $*" >&2; }
"$PY" "$ROOT/tests/e2e/fuzz.py" --self-test "$S" || { harness_error "its self-test failed"; exit 2; }
rc=0
nice "$PY" "$ROOT/tests/e2e/fuzz.py" "$BIN" "$S" "$(realpath "$BUILD")/fuzz" ${FUZZ_CASES:+--cases "$FUZZ_CASES"} || rc=$?
case $rc in
  0) ;;
  1 | 3) echo "FAIL: fuzz: a case of shardtrain crashed, hung or failed without a clean refusal (see above)" >&2 ;;&
  2 | 3) harness_error "see 'fuzz harness error' above (exit status $rc)" ;;
  1) ;;
  *) harness_error "fuzz.py ended with exit status $rc"; rc=2 ;;
esac
exit "$rc"
