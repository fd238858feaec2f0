#!/usr/bin/env bash
# float8 (issue 57, items 3-4) against torch: tests/unit/test_fp8.cpp Fp8.DISABLED_EncodeAndScaleEqualTorch
# reads what tests/e2e/fp8_torch_ref.py wrote with torch's own conversions (float8_e4m3fn, float8_e5m2):
# every byte of fp8_math.h's round-to-nearest-even encoding of ~2.1 million float32 values (edge
# cases, every fp8 value and midpoint, random bit patterns, log-uniform magnitudes from 2^-24 to
# 2^18), saturating against torch.clamp(x, -max, max).to(dtype) (torchao's cast) and E5M2's
# overflow against x.to(float8_e5m2); torchao's tensorwise scale formula; and torchao's tensorwise
# cast of six tensors (amax 0 to 3e4). Takes a few seconds (the torch import).
source "$(dirname "$0")/common.sh"
"$PY" "$ROOT/tests/e2e/fp8_torch_ref.py" "$WORK/ref" >"$WORK/ref.log" 2>&1 || { cat "$WORK/ref.log"; fail "torch's references"; }
cat "$WORK/ref.log"
SHARDTRAIN_TEST_FP8_TORCH=$WORK/ref timeout -k 5 120 "$(dirname "$BIN")/unit_tests" --gtest_also_run_disabled_tests \
  --gtest_filter='Fp8.DISABLED_EncodeAndScaleEqualTorch' >"$WORK/fp8.log" 2>&1 || { cat "$WORK/fp8.log"; fail "fp8 against torch"; }
grep '^\[ fp8 vs torch \]' "$WORK/fp8.log"
grep -q '\[  PASSED  \] 1 test' "$WORK/fp8.log" || { cat "$WORK/fp8.log"; fail "the test did not run"; }
echo "ok: float8 encoding, scales and tensorwise casts equal torch's"
