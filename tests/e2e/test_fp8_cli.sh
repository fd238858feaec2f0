#!/usr/bin/env bash
# '--precision fp8' (issue 57 item 3) is refused where it cannot run, on every rank, exit non-zero:
# on the CPU (explicit '--device cpu'; the float8 GEMMs need FP8 tensor cores, sm_89 or newer) and
# with a mixture-of-experts model (its experts and router are not quantized), and so does
# `--mode plan` (a CPU plan, an MoE model); a GPU plan counts the fp8 copies (test_device_plan.cpp
# checks the figure).
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
BASE=(--data "$DATA" --seq-len 16 --threads 1 --global-batch 4 --steps 1)
expect_fail fp8_on_cpu "option '--precision fp8' needs a GPU with FP8 tensor cores (compute capability 8.9 or newer" \
  2 --model tiny "${BASE[@]}" --device cpu --precision fp8
expect_fail fp8_moe "option '--precision fp8' does not support mixture-of-experts models (tiny-moe)" \
  2 --model tiny-moe "${BASE[@]}" --device cpu --precision fp8
expect_fail fp8_misspelt "option '--precision' must be fp32, bf16 or fp8, got 'float8'" \
  2 --model tiny "${BASE[@]}" --device cpu --precision float8
expect_fail fp8_moe_config "option '--precision fp8' does not support mixture-of-experts models (MixtralForCausalLM)" \
  1 --model "$ROOT/tests/bench/moe-config.json" "${BASE[@]}" --device cpu --precision fp8
# --mode plan refuses what training refuses: a CPU plan, an MoE model.
expect_fail plan_fp8_cpu "this plan is for the CPU; give '--device cuda' for a GPU plan" \
  1 --mode plan --model tiny --device cpu --precision fp8 --seq-len 64 --micro-batch 2
expect_fail plan_fp8_moe "option '--precision fp8' does not support mixture-of-experts models (tiny-moe)" \
  1 --mode plan --model tiny-moe --device cuda --precision fp8 --seq-len 64 --micro-batch 2
# --mode plan on a CUDA device: accepted; the header says fp8 and the plan names the fp8 scratch.
timeout -k 5 60 $MPIRUN -np 1 "$BIN" --mode plan --model llama-125m --device cuda --precision fp8 --seq-len 1024 \
  --micro-batch 4 --world-size 1 >"$WORK/plan_fp8.log" 2>&1 || { cat "$WORK/plan_fp8.log"; fail "plan_fp8: refused"; }
grep -q "fp8 GEMM scratch" "$WORK/plan_fp8.log" || { cat "$WORK/plan_fp8.log"; fail "plan_fp8: the plan does not count the fp8 copies"; }
grep -q ", fp8, micro-batch" "$WORK/plan_fp8.log" || { cat "$WORK/plan_fp8.log"; fail "plan_fp8: the header does not say fp8"; }
echo "ok: plan_fp8 -> $(grep -m1 'fp8 GEMM scratch' "$WORK/plan_fp8.log" | cut -c1-160)"
echo "test_fp8_cli: all passed"
