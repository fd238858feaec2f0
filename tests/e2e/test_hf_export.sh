#!/usr/bin/env bash
# Hugging Face export, checked by transformers, tokenizers and safetensors themselves.
# Four tiny Llama configs (tied head, untied head, GQA 8 query heads over 2 KV heads, vocab 300),
# each trained 3 steps at 3 ranks with a checkpoint, then exported at world size 1 (fp32):
#  * AutoModelForCausalLM loads each export with no missing / unexpected / mismatched keys and no
#    "newly initialized" weights;
#  * the export's AutoTokenizer gives exactly the ids `--mode generate` feeds (the token file's BOS +
#    UTF-8 bytes) for a non-ASCII prompt, "ROMEO:" and the empty string, and transformers' fp32
#    logits on those ids equal the logits shardtrain dumps itself (--dump-logits) within 1e-4;
#  * tied exports write no lm_head.weight, untied ones do; config.json's vocab_size = embedding rows;
#  * AutoTokenizer's ids are BOS + the UTF-8 bytes of varied texts ("<s>" and "</s>" included), the bare
#    bytes with add_special_tokens=False, decode round-trips, and pipeline("text-generation") generates text;
#  * bf16 / fp16 exports equal torch's round-to-nearest-even of the fp32 export, bitwise, also for a copy of
#    the checkpoint with rounding edge cases written in by h5py (ties, fp16 subnormals, overflow);
#  * a sharded export (--max-shard-size 20KB, at 2 ranks) has a consistent index, loads, and gives
#    the unsharded export's logits; every .safetensors file of every export passes a strict check of
#    the format (header length, __metadata__, contiguous offsets, sizes, no trailing bytes).
# The checks themselves are in hf_export_check.py (one Python process: transformers imports once).
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
CHECK=$ROOT/tests/e2e/hf_export_check.py
# About 40 characters, 51 UTF-8 bytes: accents, an em dash, CJK, an emoji, a tab.
PROMPT=$'Grüße aus Köln — naïve café,\t日本 🙂 ok?'

# config NAME VOCAB HIDDEN INTERMEDIATE LAYERS HEADS KV_HEADS TIED [EXTRA_JSON]
config() {
  cat >"$WORK/$1.json" <<J
{"architectures": ["LlamaForCausalLM"], "vocab_size": $2, "hidden_size": $3, "intermediate_size": $4,
 "num_hidden_layers": $5, "num_attention_heads": $6, "num_key_value_heads": $7, "max_position_embeddings": 64,
 "tie_word_embeddings": $8, "bos_token_id": 256, "eos_token_id": 257${9:-}}
J
}
config tied 258 32 64 2 4 4 true
config untied 258 32 48 2 4 2 false
config gqa 258 64 96 2 8 2 true ', "rope_theta": 500000.0, "rms_norm_eps": 1e-5'
config v300 300 48 64 1 4 4 false

# export NAME CKPT OUTDIR WANT_IN_LOG ARGS...: export and check shardtrain's own summary line.
export_hf() {
  local name=$1 ck=$2 out=$3 want=$4
  shift 4
  timeout -k 5 120 "$@" --mode export "$ck" --out "$out" >"$WORK/export_$name.log" 2>&1 \
    || { cat "$WORK/export_$name.log"; fail "export $name"; }
  grep -qF -- "$want" "$WORK/export_$name.log" || { cat "$WORK/export_$name.log"; fail "export $name: log lacks '$want'"; }
}

for c in tied untied gqa v300; do
  timeout -k 5 120 $MPIRUN -np 3 "$BIN" --model "$WORK/$c.json" --data "$DATA" --seq-len 16 --global-batch 6 --steps 3 \
    --threads 1 --checkpoint-dir "$WORK/ck_$c" >"$WORK/train_$c.log" 2>&1 || { cat "$WORK/train_$c.log"; fail "training $c at 3 ranks"; }
  CK=$WORK/ck_$c/step_00000003.h5
  [ -f "$CK" ] || fail "$c: no checkpoint at step 3"
  export_hf "$c" "$CK" "$WORK/hf_$c" "F32" "$BIN"
  grep -q "at world size 1" "$WORK/export_$c.log" || fail "export $c: not at world size 1"
  for p in "prompt:$PROMPT" "romeo:ROMEO:" "empty:"; do  # hf_export_check.py's PROMPTS
    timeout -k 5 60 "$BIN" --mode generate "$CK" --prompt "${p#*:}" --max-new-tokens 0 \
      --dump-logits "$WORK/logits_${c}_${p%%:*}.bin" >"$WORK/generate_$c.log" 2>&1 \
      || { cat "$WORK/generate_$c.log"; fail "generate --dump-logits $c, prompt ${p%%:*}"; }
  done
done
echo "ok: 4 configs trained 3 steps at 3 ranks, exported at 1 rank (fp32), logits dumped for a $(printf %s "$PROMPT" | wc -c)-byte prompt, \"ROMEO:\" and \"\""

CK=$WORK/ck_untied/step_00000003.h5
export_hf untied_bf16 "$CK" "$WORK/hf_untied_bf16" "BF16" "$BIN" --dtype bf16
export_hf untied_fp16 "$CK" "$WORK/hf_untied_fp16" "F16" "$BIN" --dtype fp16
export_hf untied_sharded "$CK" "$WORK/hf_untied_sharded" "at world size 2" $MPIRUN -np 2 "$BIN" --max-shard-size 20KB
"$PY" "$CHECK" --edge-values "$CK" "$WORK/edge.h5" || fail "writing edge values into a checkpoint copy"
for dt in fp32:F32 bf16:BF16 fp16:F16; do
  export_hf "edge_${dt%:*}" "$WORK/edge.h5" "$WORK/hf_edge_${dt%:*}" "${dt#*:}" "$BIN" --dtype "${dt%:*}"
done
nfiles=$(grep -o "in [0-9]* safetensors file(s)" "$WORK/export_untied_sharded.log" | tr -dc 0-9)
[ "${nfiles:-0}" -gt 1 ] || { cat "$WORK/export_untied_sharded.log"; fail "sharded export wrote ${nfiles:-no} file(s)"; }
echo "ok: bf16 and fp16 exports (and fp32 of the edge-value copy) at 1 rank; sharded export (20KB) at 2 ranks wrote $nfiles files"

timeout -k 5 200 "$PY" "$CHECK" "$WORK" "$PROMPT" || fail "hf_export_check.py (status $?)"
