#!/usr/bin/env bash
# --attention-mask document (issue 41) against transformers. A token file whose train and
# validation splits are each one packed sequence of T + 1 = 161 tokens (document_mask_check.py
# make: documents of 2 to 90 tokens, the train split starting inside one), so the batches shardtrain
# trains and evaluates on are known. A model initialized with std 0.1 (attention far from uniform,
# so the two masks' losses differ by ~0.04), one step at --lr 1e-30 (an update far below the
# weights' fp32 resolution), its checkpoint exported; then transformers (fp32, CPU, eager attention) computes the mean loss of
# the same tokens, given position_ids restarting per document and the block-diagonal causal 4-D
# mask for document, plain for causal, and each of shardtrain's losses (step 1's training loss,
# the final val_loss: evaluation uses the run's mask) must agree within 1e-5 relative:
#   document at 2 ranks (data parallel), document at 2 ranks with --tp 2, document with
#   --attention exact and --activation-checkpointing full, causal at 2 ranks; document and causal
#   at --cp 2 (ring) and --cp 4 (allgather), one sequence split over the CP ranks; and document with
#   --precision bf16 within 2e-3 (and nearer the document reference than the causal one).
# And '--attention-mask document' with data that has no EOS id (a nanoGPT file) is refused on
# every rank, naming the option and the file; an unknown mask value is refused naming the option; a
# resume that changes the mask is refused unless '--accept-change attention-mask'.
source "$(dirname "$0")/common.sh"
CHECK=$ROOT/tests/e2e/document_mask_check.py
T=160
"$PY" "$CHECK" make $T "$WORK/docs.tok" "$WORK/noeos.bin" || fail "writing the token files"
cat >"$WORK/cfg.json" <<J
{"architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 64, "intermediate_size": 96,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
 "tie_word_embeddings": false, "bos_token_id": 256, "eos_token_id": 257, "rope_theta": 10000.0, "initializer_range": 0.1}
J
TRAIN=(--model "$WORK/cfg.json" --data "$WORK/docs.tok" --seq-len $T --lr 1e-30 --min-lr 0 --warmup 0
       --eval-every 0 --eval-batches 1 --threads 1)
run() {  # name np args...: a training run with metrics in $WORK/name.jsonl
  local name=$1 np=$2
  shift 2
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" "${TRAIN[@]}" --steps 1 --metrics "$WORK/$name.jsonl" "$@" >"$WORK/$name.log" 2>&1 \
    || { cat "$WORK/$name.log"; fail "$name"; }
}
run doc 2 --global-batch 2 --attention-mask document --checkpoint-dir "$WORK/ck"
grep -q "document mask" "$WORK/doc.log" || { cat "$WORK/doc.log"; fail "doc: the memory plan does not name the document mask"; }
# The step line and the metrics count the attention tile pairs the mask let the kernels skip:
# T = 160 is 3 x 3 tile pairs per (sequence, head), 6 on and below the diagonal; the documents of
# the train split leave some of those 6 fully masked too, so more than 3 of 9 are skipped.
grep -qE "attn tiles skipped [0-9]+%" "$WORK/doc.log" || { cat "$WORK/doc.log"; fail "doc: no 'attn tiles skipped' in the step line"; }
"$PY" - "$WORK/doc.jsonl" <<'P' || fail "doc: attention tile counts in the metrics"
import json, sys
r = next(json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l)
pairs, skipped = r["attn_tile_pairs"], r["attn_tiles_skipped"]
# Rank 0: 1 sequence x 4 heads x 2 layers x (forward + backward) x 9 tile pairs.
assert pairs == 1 * 4 * 2 * 2 * 9, pairs
assert skipped > pairs / 3, (skipped, pairs)
print(f"ok: metrics: {skipped:g} of {pairs:g} attention tile pairs skipped per step (causal skips {pairs / 3:g})")
P
run doc_tp2 2 --global-batch 1 --attention-mask document --tp 2
run doc_exact_full 1 --global-batch 1 --attention-mask document --attention exact --activation-checkpointing full
run causal 2 --global-batch 2
run doc_bf16 2 --global-batch 2 --attention-mask document --precision bf16
# Context parallelism (T = 160 is divisible by 2 cp): each rank holds head-tail rows of the one
# sequence, so transformers' whole-sequence loss checks the CP split, positions and masks.
run doc_cp2_ring 2 --global-batch 1 --attention-mask document --cp 2 --cp-comm ring
run doc_cp4_gather 4 --global-batch 1 --attention-mask document --cp 4 --cp-comm allgather
run causal_cp2_ring 2 --global-batch 1 --cp 2 --cp-comm ring
run causal_cp4_gather 4 --global-batch 1 --cp 4 --cp-comm allgather
timeout -k 5 60 "$BIN" --mode export "$WORK/ck/step_00000001.h5" --out "$WORK/hf" >"$WORK/export.log" 2>&1 \
  || { cat "$WORK/export.log"; fail "export"; }
timeout -k 5 200 "$PY" "$CHECK" check $T "$WORK/docs.tok" "$WORK/hf" doc="$WORK/doc.jsonl" doc_tp2="$WORK/doc_tp2.jsonl" \
  doc_exact_full="$WORK/doc_exact_full.jsonl" causal="$WORK/causal.jsonl" \
  doc_bf16="$WORK/doc_bf16.jsonl" doc_cp2_ring="$WORK/doc_cp2_ring.jsonl" doc_cp4_gather="$WORK/doc_cp4_gather.jsonl" \
  causal_cp2_ring="$WORK/causal_cp2_ring.jsonl" causal_cp4_gather="$WORK/causal_cp4_gather.jsonl" || fail "document_mask_check.py (status $?)"

expect_fail no_eos "option '--attention-mask document' needs the data's EOS id (documents end at it), but the token data '$WORK/noeos.bin' (nanogpt (u16))" \
  2 --model tiny --data "$WORK/noeos.bin" --val-data "$WORK/noeos.bin" --data-format nanogpt --seq-len 16 --global-batch 2 \
  --attention-mask document --threads 1
# Every file must name the EOS: an llm.c shard (no EOS id in its header) beside a shardtrain file
# that names one is refused too, naming the llm.c file (its documents would not end at that id).
"$PY" - "$WORK/llmc.bin" <<'P'
import random, struct, sys
rnd = random.Random(3)
toks = [rnd.randrange(256) for _ in range(4096)]
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)) + struct.pack(f"<{len(toks)}H", *toks))
P
expect_fail mixed_eos "needs the data's EOS id (documents end at it), but the token data '$WORK/llmc.bin' (llm.c gpt-2 (u16)) names none" \
  2 --model tiny --data "$WORK/docs.tok" --data "$WORK/llmc.bin" --val-data "$WORK/docs.tok" --seq-len 16 --global-batch 2 \
  --attention-mask document --threads 1
# A resume that changes the mask is refused (the objective would change mid-run), unless accepted.
expect_fail resume_mask_change "--attention-mask \"document\" -> \"causal\"" 2 "${TRAIN[@]}" --global-batch 2 --steps 2 \
  --checkpoint-dir "$WORK/ck" --resume auto
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${TRAIN[@]}" --global-batch 2 --steps 2 --checkpoint-dir "$WORK/ck" --resume auto \
  --accept-change steps,attention-mask >"$WORK/resume_ok.log" 2>&1 || { cat "$WORK/resume_ok.log"; fail "resume accepting the change"; }
grep -qF -- "accepted change --attention-mask \"document\" -> \"causal\"" "$WORK/resume_ok.log" \
  || { cat "$WORK/resume_ok.log"; fail "resume_ok: no note of the accepted change"; }
echo "ok: a resume changing --attention-mask is refused on every rank, and noted when accepted"
expect_fail bad_mask "option '--attention-mask' must be causal or document, got 'documents'" \
  2 --model tiny --data "$WORK/docs.tok" --seq-len 16 --global-batch 2 --attention-mask documents --threads 1
