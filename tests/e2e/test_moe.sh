#!/usr/bin/env bash
# Mixture-of-experts blocks (issue 56) against transformers: tiny MixtralForCausalLM and
# Qwen3MoeForCausalLM models made by transformers (tests/e2e/moe_check.py), their weights loaded
# by name into shardtrain's model (tests/mpi/test_moe.cpp Moe.DISABLED_LogitsAndLossEqualTransformers):
# fp32 logits within 1e-5, cross-entropy, load-balancing loss and their sum within 1e-6.
source "$(dirname "$0")/common.sh"
"$PY" "$ROOT/tests/e2e/moe_check.py" "$WORK/ref" >"$WORK/make.log" 2>&1 || { cat "$WORK/make.log"; fail "making the MoE references"; }
grep '^ok' "$WORK/make.log"
SHARDTRAIN_TEST_MOE_TORCH=$WORK/ref timeout -k 5 300 "$(dirname "$BIN")/mpi_tests" --gtest_also_run_disabled_tests \
  --gtest_filter='Moe.DISABLED_LogitsAndLossEqualTransformers' >"$WORK/moe.log" 2>&1 || { cat "$WORK/moe.log"; fail "MoE against transformers"; }
grep '^\[ MoE vs transformers \]' "$WORK/moe.log"
grep -q '\[  PASSED  \] 1 test' "$WORK/moe.log" || { cat "$WORK/moe.log"; fail "the test did not run"; }
echo "ok: Mixtral and Qwen3-MoE logits and losses equal transformers'"
