#!/usr/bin/env bash
# Qwen3ForCausalLM (issue 56: Llama with an RMSNorm over each head's query and key before RoPE),
# checked by transformers itself (qwen3_check.py):
#  * models made by transformers (untied and tied, head_dim 16 != 48 / 4, GQA, q/k norm weights
#    away from ones), imported at 2 and 3 ranks: shardtrain's fp32 logits equal transformers' within
#    1e-5, and the same weights without the norm would not;
#  * import + export gives every tensor back bitwise, config.json Qwen3ForCausalLM, loaded by
#    transformers without warnings;
#  * trained 3 steps from the import at tp 2 x dp 2 (the norm weights replicated over the TP group,
#    their gradient summed), exported: transformers' logits of the trained model equal shardtrain's.
source "$(dirname "$0")/common.sh"
CHECK=$ROOT/tests/e2e/qwen3_check.py
"$PY" "$CHECK" make "$WORK" >"$WORK/make.log" 2>&1 || { cat "$WORK/make.log"; fail "making Qwen3 models"; }
grep "^ok" "$WORK/make.log"
IDS=$(cat "$WORK/ids.txt")
DATA=$(test_corpus)

for spec in qwen3:2 qwen3_tied:3; do
  name=${spec%:*} np=${spec#*:}
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" --mode import --hf-dir "$WORK/$name" --out "$WORK/$name.h5" >"$WORK/$name.imp.log" 2>&1 \
    || { cat "$WORK/$name.imp.log"; fail "$name: import at $np ranks"; }
  grep -qF 'self_attn.q_norm.weight [16]' <("$BIN" --mode inspect "$WORK/$name.h5") || fail "$name: inspect lacks q_norm [16]"
  timeout -k 5 120 $MPIRUN -np 2 "$BIN" --mode generate "$WORK/$name.h5" --prompt-ids "$IDS" --max-new-tokens 0 \
    --dump-logits "$WORK/$name.logits" >"$WORK/$name.gen.log" 2>&1 || { cat "$WORK/$name.gen.log"; fail "$name: generate"; }
  timeout -k 5 300 "$PY" "$CHECK" logits "$WORK" "$name" "$name.logits" || fail "$name: logits"
  timeout -k 5 120 "$BIN" --mode export "$WORK/$name.h5" --out "$WORK/$name.out" >"$WORK/$name.exp.log" 2>&1 \
    || { cat "$WORK/$name.exp.log"; fail "$name: export"; }
  timeout -k 5 300 "$PY" "$CHECK" export "$WORK" "$name" "$name.out" || fail "$name: export checks"
done

# Fine-tune from the import with the norm weights replicated over a TP group, then export.
timeout -k 5 300 $MPIRUN -np 4 "$BIN" --model "$WORK/qwen3/config.json" --init-from "$WORK/qwen3.h5" --data "$DATA" \
  --tp 2 --seq-len 32 --global-batch 4 --steps 3 --lr 1e-3 --threads 1 --checkpoint-dir "$WORK/ft" >"$WORK/ft.log" 2>&1 \
  || { cat "$WORK/ft.log"; fail "training from the import at tp 2 x dp 2"; }
grep -q '^step 3/3 | loss' "$WORK/ft.log" || { cat "$WORK/ft.log"; fail "no step 3 loss"; }
CK=$WORK/ft/step_00000003.h5
timeout -k 5 120 "$BIN" --mode export "$CK" --out "$WORK/trained" >"$WORK/trained.exp.log" 2>&1 \
  || { cat "$WORK/trained.exp.log"; fail "exporting the trained model"; }
timeout -k 5 120 $MPIRUN -np 2 "$BIN" --mode generate "$CK" --prompt-ids "$IDS" --max-new-tokens 0 \
  --dump-logits "$WORK/trained.logits" >"$WORK/trained.gen.log" 2>&1 || { cat "$WORK/trained.gen.log"; fail "trained: generate"; }
timeout -k 5 300 "$PY" "$CHECK" logits "$WORK" trained trained.logits || fail "trained: logits"
"$PY" - "$WORK/qwen3" "$WORK/trained" <<'PY' || fail "the q/k norm weights did not train"
import sys
from safetensors.torch import load_file
a, b = load_file(f"{sys.argv[1]}/model.safetensors"), load_file(f"{sys.argv[2]}/model.safetensors")
for k in ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"):
    d = float((a[k] - b[k]).abs().max())
    assert d > 1e-5, f"{k} moved by only {d:.2e} in 3 steps"
print("ok: 3 steps at tp 2 x dp 2 moved the q/k norm weights; transformers' logits of the export equal shardtrain's")
PY

# A Qwen3 checkpoint given to a Llama config of the same shape, and the reverse, are refused by name
# on every rank (the weights would mean something else); a Llama checkpoint whose model_config is
# edited to claim Qwen3 (resealed) is refused by inspect and export: its block units lack the
# 2 x 2 x 8 elements of the norm weights.
"$PY" - "$WORK/qwen3/config.json" "$WORK/llama.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(architectures=["LlamaForCausalLM"], model_type="llama")
json.dump(c, open(sys.argv[2], "w"))
PY
timeout -k 5 120 $MPIRUN -np 2 "$BIN" --model "$WORK/llama.json" --data "$DATA" --seq-len 32 --global-batch 4 --steps 1 \
  --threads 1 --checkpoint-dir "$WORK/llama_ck" >"$WORK/llama.log" 2>&1 || { cat "$WORK/llama.log"; fail "llama: 1 step"; }
ARGS=(--data "$DATA" --seq-len 32 --global-batch 4 --steps 1 --threads 1)
expect_fail qwen3_into_llama "architecture" 2 --model "$WORK/llama.json" --init-from "$WORK/qwen3.h5" "${ARGS[@]}"
expect_fail llama_into_qwen3 "architecture" 2 --model "$WORK/qwen3/config.json" --init-from "$WORK/llama_ck/step_00000001.h5" "${ARGS[@]}"
cp "$WORK/llama_ck/step_00000001.h5" "$WORK/claims_qwen3.h5"
"$PY" - "$WORK/claims_qwen3.h5" "$ROOT/tests/e2e" <<'PY' || fail "editing model_config"
import json, sys, h5py
sys.path.insert(0, sys.argv[2])
import ckpt_meta
with h5py.File(sys.argv[1], "r+") as f:
    v = f.attrs["model_config"]
    c = json.loads(v.decode() if isinstance(v, bytes) else v)
    c.update(architecture="Qwen3ForCausalLM", qk_norm=True)
    f.attrs["model_config"] = json.dumps(c, sort_keys=True, separators=(",", ":"))
ckpt_meta.reseal(sys.argv[1])
PY
expect_fail inspect_claims_qwen3 "unit 'model.layers.0' holds 23136 elements (attribute 'numel'), expected 23168" 1 --mode inspect "$WORK/claims_qwen3.h5"
expect_fail export_claims_qwen3 "unit 'model.layers.0' holds 23136 elements" 1 --mode export "$WORK/claims_qwen3.h5" --out "$WORK/x_qwen3"
