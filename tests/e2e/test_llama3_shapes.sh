#!/usr/bin/env bash
# Llama-3-style shapes end to end, checked by transformers itself (llama3_shapes_check.py):
#  * a u32 token file (bytes per token 4) with vocab 128256 and ids over the whole range, most of
#    them above 65535, BOS 128000 / EOS 128001;
#  * a config.json with head_dim 24 != hidden_size / num_attention_heads (64 / 4), GQA 4:2, and
#    llama3 RoPE scaling in transformers 4.x form (rope_theta + rope_scaling {"type": "llama3"}),
#    original_max_position_embeddings 16 so that the scaling changes the frequencies at length 32;
#  * trained 3 steps at 2 ranks, exported: config.json has transformers' head_dim and
#    rope_parameters, transformers loads it without warnings, and its fp32 logits on [BOS] + 33 ids
#    (most above 65535, --mode generate --prompt-ids --dump-logits) equal shardtrain's within 1e-4;
#    with plain RoPE they would not;
#  * --mode import of transformers-made directories with such a config (5.x rope_parameters, and
#    4.x rope_theta + rope_scaling as Llama 3.1 ships it): shardtrain's logits equal transformers'.
source "$(dirname "$0")/common.sh"
CHECK=$ROOT/tests/e2e/llama3_shapes_check.py
"$PY" "$CHECK" make "$WORK" || fail "making inputs"
IDS=$(cat "$WORK/ids.txt")

timeout -k 5 300 $MPIRUN -np 2 "$BIN" --model "$WORK/train.json" --data "$WORK/u32.tok" --seq-len 32 --global-batch 4 \
  --steps 3 --threads 1 --checkpoint-dir "$WORK/ck" >"$WORK/train.log" 2>&1 || { cat "$WORK/train.log"; fail "training at 2 ranks"; }
CK=$WORK/ck/step_00000003.h5
[ -f "$CK" ] || { cat "$WORK/train.log"; fail "no checkpoint at step 3"; }
grep -q '^step 3/3 | loss' "$WORK/train.log" || { cat "$WORK/train.log"; fail "no step 3 loss"; }
INSPECT=$("$BIN" --mode inspect "$CK")
for want in '"head_dim":24' '"rope_scaling":{"factor":8.0,"high_freq_factor":4.0,"low_freq_factor":1.0,"original_max_position_embeddings":16,"rope_type":"llama3"}' \
            '"vocab_size":128256' 'self_attn.q_proj.weight [96, 64]' 'self_attn.o_proj.weight [64, 96]'; do
  grep -qF -- "$want" <<<"$INSPECT" || { echo "$INSPECT" | head -30; fail "inspect lacks '$want'"; }
done
echo "ok: trained 3 steps at 2 ranks on u32 tokens (vocab 128256); the checkpoint holds head_dim 24 and the llama3 rope_scaling"

timeout -k 5 120 "$BIN" --mode export "$CK" --out "$WORK/hf_export" >"$WORK/export.log" 2>&1 || { cat "$WORK/export.log"; fail "export"; }
timeout -k 5 120 $MPIRUN -np 2 "$BIN" --mode generate "$CK" --prompt-ids "$IDS" --max-new-tokens 0 \
  --dump-logits "$WORK/logits_export.bin" >"$WORK/gen.log" 2>&1 || { cat "$WORK/gen.log"; fail "generate --prompt-ids --dump-logits"; }
timeout -k 5 300 "$PY" "$CHECK" export "$WORK" || fail "export checks"

for name in hf_v5 hf_v4; do
  timeout -k 5 120 $MPIRUN -np 2 "$BIN" --mode import --hf-dir "$WORK/$name" --out "$WORK/$name.h5" >"$WORK/$name.imp.log" 2>&1 \
    || { cat "$WORK/$name.imp.log"; fail "$name: import"; }
  timeout -k 5 120 "$BIN" --mode generate "$WORK/$name.h5" --prompt-ids "$IDS" --max-new-tokens 0 \
    --dump-logits "$WORK/logits_$name.bin" >"$WORK/$name.gen.log" 2>&1 || { cat "$WORK/$name.gen.log"; fail "$name: generate"; }
  timeout -k 5 300 "$PY" "$CHECK" import "$WORK" "$name" || fail "$name: logits"
done
cmp -s <("$BIN" --mode inspect "$WORK/hf_v5.h5" | grep model_config) <("$BIN" --mode inspect "$WORK/hf_v4.h5" | grep model_config) \
  || fail "rope_parameters and rope_scaling forms of one config imported to different model configs"
echo "ok: both config.json forms import to the same model config"

# Token ids outside the vocabulary are refused by name.
expect_fail prompt_ids_oov "option '--prompt-ids': '128256' is not a token id in [0, 128256)" 2 --mode generate "$CK" \
  --prompt-ids 5,128256 --max-new-tokens 0

# A checkpoint written before head_dim and rope_scaling were part of the model config (its
# model_config attribute lacks both keys, checksums resealed) still resumes, exports and generates.
DATA=$(test_corpus)
timeout -k 5 120 $MPIRUN -np 2 "$BIN" --model tiny --data "$DATA" --seq-len 16 --global-batch 4 --steps 3 --stop-at-step 2 \
  --threads 1 --checkpoint-dir "$WORK/old" >"$WORK/old.log" 2>&1 || { cat "$WORK/old.log"; fail "tiny: 2 steps"; }
"$PY" - "$WORK/old/step_00000002.h5" "$ROOT/tests/e2e" <<'PY' || fail "rewriting model_config as an older version wrote it"
import sys, h5py
sys.path.insert(0, sys.argv[2])
import ckpt_meta
with h5py.File(sys.argv[1], "r+") as f:
    v = f.attrs["model_config"]
    v = v.decode() if isinstance(v, bytes) else v
    old = v.replace(',"head_dim":8', "").replace(',"rope_scaling":null', "")
    assert old.count("head_dim") == 0 and old.count("rope_scaling") == 0 and len(old) < len(v), v
    f.attrs["model_config"] = old
ckpt_meta.reseal(sys.argv[1])
PY
grep -q '"head_dim"' <("$BIN" --mode inspect "$WORK/old/step_00000002.h5" | grep model_config) && fail "model_config still has head_dim"
timeout -k 5 120 $MPIRUN -np 2 "$BIN" --model tiny --data "$DATA" --seq-len 16 --global-batch 4 --steps 3 --threads 1 \
  --checkpoint-dir "$WORK/old" --resume auto >"$WORK/old_resume.log" 2>&1 || { cat "$WORK/old_resume.log"; fail "resuming the older checkpoint"; }
grep -q '^step 3/3' "$WORK/old_resume.log" || { cat "$WORK/old_resume.log"; fail "older checkpoint: no step 3"; }
timeout -k 5 60 "$BIN" --mode export "$WORK/old/step_00000002.h5" --out "$WORK/old_hf" >"$WORK/old_export.log" 2>&1 \
  || { cat "$WORK/old_export.log"; fail "exporting the older checkpoint"; }
echo "ok: a checkpoint whose model_config has neither head_dim nor rope_scaling (older versions) resumes and exports"
