#!/usr/bin/env bash
# The CUDA backend's memory-bound kernels move 16 bytes per load and store (issue 57, item 1;
# src/backend/cuda/cuda_common.cuh, "16-byte vector access"). Checked without a GPU, in the PTX nvcc
# writes for sm_90: each kernel's packed instantiation (V = 4 floats or 8 bf16) has 128-bit global
# loads and stores (ld.global.v4 / st.global.v4; its tail loop keeps scalar ones), and its scalar
# instantiation (V = 1), which the host takes for misaligned pointers, exists. Whether the kernels compute the right values is tests/gpu's (stage 2 of
# tests/gpu/run.sh, against the CPU backend); their speed is stage 5e's (tests/bench/kernel_bench.cpp).
# Skipped (exit 77) without nvcc.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; } || true)
if [ -z "$NVCC" ]; then echo "skipped: nvcc not found"; exit 77; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# file: kernels whose packed instantiation must be vectorized
declare -A KERNELS=(
  [swiglu]="swiglu_forward_kernel swiglu_backward_kernel"
  [norm]="rmsnorm_forward_kernel rmsnorm_backward_dx_kernel"
  [rope]="rope_kernel rope_at_kernel rope_qk_kernel"
  [optimizer]="axpy_kernel scale_kernel adamw_kernel"
  [gemm]="from_f32_kernel add_to_f32_kernel"
)
checked=0
for f in "${!KERNELS[@]}"; do
  "$NVCC" -std=c++20 -O3 -Iinclude -DSHARDTRAIN_CUDA=1 -arch=compute_90 -ptx "src/backend/cuda/$f.cu" \
    -o "$WORK/$f.ptx" 2>"$WORK/$f.err" || { cat "$WORK/$f.err"; fail "nvcc -ptx src/backend/cuda/$f.cu"; }
  for k in ${KERNELS[$f]}; do
    # Each type: float (V = 4, mangled Li4E) and bf16 (V = 8, Li8E) packed; V = 1 (Li1E) the fallback.
    for spec in "If:Li4E" "INS_4bf16E:Li8E"; do
      ty=${spec%%:*} v=${spec#*:}
      body=$(awk -v k="${k}${ty}${v}" -v k2="${k}${ty}Li1E" '
        /^(\.visible )?\.entry / { inside = (index($0, k) > 0); seen1 = seen1 || (index($0, k2) > 0) }
        inside { print }
        END { if (!seen1) print "NO-FALLBACK" }' "$WORK/$f.ptx")
      grep -q "entry" <<<"$body" || fail "$f.cu: no packed instantiation of $k (${ty} ${v}) in the PTX"
      grep -q "NO-FALLBACK" <<<"$body" && fail "$f.cu: no scalar (V = 1) instantiation of $k (${ty})"
      vl=$(grep -cE 'ld\.global(\.nc)?\.v(4|2\.u64|2\.f64)' <<<"$body" || true)
      vs=$(grep -cE 'st\.global\.v(4|2\.u64|2\.f64)' <<<"$body" || true)
      [ "$vl" -gt 0 ] && [ "$vs" -gt 0 ] || fail "$f.cu: $k (${ty} ${v}): $vl 128-bit loads, $vs 128-bit stores in its PTX"
      checked=$((checked + 1))
    done
  done
done
[ "$checked" = 24 ] || fail "checked $checked kernel instantiations, expected 24 (12 kernels x 2 types)"
echo "ok: $checked packed kernel instantiations (12 kernels x float, bf16) load and store 16 bytes at a time in sm_90 PTX, each with a scalar fallback"
