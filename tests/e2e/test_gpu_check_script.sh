#!/usr/bin/env bash
# tests/gpu/run.sh, the device check, run here with GPU_CHECK_DEVICE=cpu (its "GPU" runs on the CPU)
# so that the script itself is tested on every CI run: every stage runs, every comparison passes,
# the benchmark table has its rows, the PyTorch peer (tests/gpu/peer.py, here on the CPU, eager) runs
# beside the tiny bf16 row with its ratio, the asynchronous-save comparison (stage 4b) passes on the
# CPU, and the script exits 0 with "0 failed". Then the GPU runs with
# another seed (GPU_CHECK_ARGS="--seed 7") must fail the 6 training comparisons, the 2 of TP (stage
# 3b), the 4 of CP (stage 3c), the 4 of PP (stage 3d), the 4 of MoE (stage 3f, --ep 2 included), both resumes across
# devices (refused: the seed of the resuming run differs from the checkpoint's, and a resume does not
# change settings silently), and the script's exit status.
source "$(dirname "$0")/common.sh"
BUILD_DIR=$(realpath "$BUILD")
check() {  # check NAME EXTRA_ENV...: runs the script (EXTRA_ENV last: it overrides); its output in $WORK/NAME.txt, status in $rc
  local name=$1
  shift
  rc=0
  env GPU_BUNDLE=none GPU_CHECK_BUILD="$BUILD_DIR" GPU_CHECK_DEVICE=cpu GPU_CHECK_DIR="$WORK/$name" \
    BENCH_MODELS="tiny:fp32 tiny:bf16" BENCH_SEQ=32 BENCH_BATCH=4 GPU_CHECK_BUDGET_S=240 "$@" \
    timeout -k 5 300 bash "$ROOT/tests/gpu/run.sh" >"$WORK/$name.txt" 2>&1 || rc=$?
}
# The case count run.sh's stage 2 reports: as many as gpu_tests lists, less stage 2b's snapshot case.
NCASES=$("$BUILD_DIR/gpu_tests" --gtest_list_tests --gtest_filter='-Gpu.CheckpointSnapshot*' | grep -c '^  ')
check ok PEER_MODELS=tiny:32:4 PEER_PY="$ROOT/.venv/bin/python"
[ "$rc" = 0 ] || { cat "$WORK/ok.txt"; fail "run.sh exit status $rc"; }
for want in 'PASS  env: shardtrain runs under mpirun' "SKIP  gpu_tests ($NCASES cases): skipped: no CUDA device" \
  'PASS  gpu-fp32-np1 vs cpu-fp32' 'PASS  gpu-uneven-np2 vs cpu-uneven' 'PASS  gpu-bf16r-np2 vs cpu-fp32' \
  'PASS  ckpt-gpu-to-cpu vs cpu-fp32' 'PASS  ckpt-cpu-to-gpu vs cpu-fp32' 'PASS  bench-tiny-fp32' '| tiny | ' \
  'PASS  gpu-moe-ep2 vs cpu-moe-ref' \
  'PASS  peer-tiny-32x4: tokens_per_s=' '| tiny | 32 | 4 | ' \
  'SKIP  sanitizer-memcheck: skipped: no CUDA device' 'SKIP  mem-llama-1b: skipped: no CUDA device' \
  'SKIP  attention-bench: skipped: no CUDA device' 'SKIP  snapshot-pinned: skipped: no CUDA device' \
  'PASS  ckpt-async-gpu-fp32: ' 'PASS  ckpt-async-gpu-bf16: ' 'PASS  gpu-tp2-fp32 vs cpu-tp-ref' \
  'PASS  gpu-tp2-bf16 vs cpu-tp-ref' 'PASS  gpu-cp2-ring vs cpu-fp32' 'PASS  gpu-cp2-allgather vs cpu-fp32' \
  'PASS  gpu-cp2-doc vs cpu-doc-ref' 'PASS  gpu-cp2-bf16 vs cpu-fp32' 'PASS  cpu-pp2 vs cpu-fp32' \
  'PASS  gpu-pp2-gpipe vs cpu-fp32' 'PASS  gpu-pp2-1f1b vs cpu-fp32' 'PASS  gpu-pp2-zero-bubble vs cpu-fp32' \
  'PASS  gpu-pp2-bf16 vs cpu-fp32' 'PASS  plugin-cpu: --device cpu, 3 steps trained' \
  'PASS  gpu-sft-fp32 vs cpu-sft-ref' 'PASS  gpu-sft-tp2 vs cpu-sft-ref' 'PASS  gpu-sft-bf16 vs cpu-sft-ref' \
  'SKIP  plugin-gpu: skipped: no CUDA device'; do
  grep -qF -- "$want" "$WORK/ok.txt" || { cat "$WORK/ok.txt"; fail "run.sh output lacks '$want'"; }
done
grep -qE '^gpu: [0-9]+ passed, 0 failed' "$WORK/ok.txt" || { cat "$WORK/ok.txt"; fail "no 'gpu: N passed, 0 failed'"; }
echo "ok: run.sh (GPU_CHECK_DEVICE=cpu): $(tail -1 "$WORK/ok.txt"), $(grep -m1 -o 'gpu-bf16-np1 vs cpu-fp32: worst[^;]*' "$WORK/ok.txt")"

# The correctness part only: every comparison counted below is in stages 3-4 (the figures ran above).
check seed GPU_CHECK_ARGS="--seed 7" GPU_CHECK_PART=correctness PEER_MODELS=""
[ "$rc" != 0 ] || { cat "$WORK/seed.txt"; fail "run.sh passed with the GPU runs on another seed"; }
nfail=$(grep -c '^  FAIL  \(gpu\|ckpt\)-' "$WORK/seed.txt" || true)
[ "$nfail" = 22 ] || { cat "$WORK/seed.txt"; fail "--seed 7: $nfail of the GPU comparisons failed, expected 22 (stages 3, 3b, 3c, 3d, 3f and 4)"; }
for want in 'FAIL  ckpt-gpu-to-cpu: exit status 1' 'FAIL  ckpt-cpu-to-gpu: exit status 1' 'PASS  ckpt-cpu-to-cpu vs cpu-fp32'; do
  grep -qF -- "$want" "$WORK/seed.txt" || { cat "$WORK/seed.txt"; fail "--seed 7: no '$want'"; }
done
grep -qF -- "--seed 1337 -> 7" "$WORK/seed/logs/ckpt-cpu-to-gpu.log" || fail "--seed 7: the resume does not name the changed seed"
grep -qF -- "--seed 7 -> 1337" "$WORK/seed/logs/ckpt-gpu-to-cpu.log" || fail "--seed 7: the resume does not name the changed seed"
echo "ok: GPU runs on another seed: $nfail comparisons failed, e.g. $(grep -m1 -o 'gpu-fp32-np1 vs cpu-fp32: worst[^;]*' "$WORK/seed.txt")"

# GPU_CHECK_PART=figures (the second device call): stage 1 and the figures only, no training comparison.
check figures GPU_CHECK_PART=figures PEER_MODELS="" BENCH_MODELS="tiny:fp32"  # the stage choice, not the rows again
[ "$rc" = 0 ] || { cat "$WORK/figures.txt"; fail "GPU_CHECK_PART=figures: exit status $rc"; }
grep -qF 'PASS  bench-tiny-fp32' "$WORK/figures.txt" || { cat "$WORK/figures.txt"; fail "GPU_CHECK_PART=figures: no benchmark row"; }
! grep -E '^== (2|3|4|6)' "$WORK/figures.txt" || fail "GPU_CHECK_PART=figures ran a correctness stage"
echo "ok: GPU_CHECK_PART=figures: $(grep -c '^== ' "$WORK/figures.txt") stages (1, 5-5f), $(tail -1 "$WORK/figures.txt")"

# GPU_CHECK_STAGES (a rerun of what failed): stage 4 alone makes the CPU reference it compares with;
# a stage id that does not exist is refused (a typo must not pass as a clean run).
check stage4 GPU_CHECK_STAGES=4 PEER_MODELS=""
[ "$rc" = 0 ] || { cat "$WORK/stage4.txt"; fail "GPU_CHECK_STAGES=4: exit status $rc"; }
grep -qF 'PASS  ckpt-cpu-to-gpu vs cpu-fp32' "$WORK/stage4.txt" || { cat "$WORK/stage4.txt"; fail "GPU_CHECK_STAGES=4: no resume check"; }
check typo GPU_CHECK_STAGES="4 3x"
[ "$rc" = 2 ] && grep -qF "'3x' is no stage" "$WORK/typo.txt" || { cat "$WORK/typo.txt"; fail "GPU_CHECK_STAGES='4 3x': exit status $rc"; }
echo "ok: GPU_CHECK_STAGES=4 alone: $(tail -1 "$WORK/stage4.txt"); '3x' refused"
