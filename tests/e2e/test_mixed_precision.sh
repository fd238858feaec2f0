#!/usr/bin/env bash
# Mixed precision (--precision bf16) on the CPU backend, which is the reference of the CUDA bf16
# path: 20 steps at 2 ranks follow the fp32 losses within 2e-2 relative (gradients reduced in fp32
# and in bf16), and checkpoints (always fp32 master weights) cross between precisions both ways.
# Then the device-option refusals of docs/errors.md: every rank fails with the same message.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
ARGS=(--model tiny --data "$DATA" --seq-len 32 --global-batch 8 --steps 20 --lr 3e-3 --warmup 2 --eval-batches 1
      --log-every 1 --threads 1 --device cpu)

run() {  # run NAME ARGS...: 2 ranks, metrics in $WORK/NAME.jsonl
  local name=$1
  shift
  timeout -k 5 300 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --metrics "$WORK/$name.jsonl" "$@" >"$WORK/$name.log" 2>&1 \
    || { cat "$WORK/$name.log"; fail "$name run"; }
}
run fp32 --precision fp32
run bf16 --precision bf16
run bf16r --precision bf16 --reduce-dtype bf16
grep -q "precision bf16 (gradients reduced in bf16)" "$WORK/bf16r.log" || fail "bf16r: no precision line"

# compare A B FIRST LAST TOL: step losses FIRST..LAST (1-based lines of the metrics) of A and B
# agree within TOL relative; prints the worst difference; fails if A and B are identical (then the
# bf16 path did not run).
compare() {  # only the standard library: no venv needed
  python3 - "$@" <<'PY'
import json, sys
a, b, first, last, tol = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
def losses(p): return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "loss" in j}
la, lb = losses(a), losses(b)
steps = range(first, last + 1)
missing = [s for s in steps if s not in la or s not in lb]
assert not missing, f"steps missing: {missing}"
worst = max(abs(la[s] - lb[s]) / abs(la[s]) for s in steps)
print(f"{a.split('/')[-1]} vs {b.split('/')[-1]}, steps {first}-{last}: worst relative loss difference {worst:.2e} (limit {tol:g}); "
      f"loss {la[first]:.4f} -> {la[last]:.4f}")
assert worst <= tol, "too far apart"
assert worst > 0, "identical losses: the bf16 path did not run"
assert la[last] < la[first] - 0.1, "the loss did not fall"
PY
}
compare "$WORK/fp32.jsonl" "$WORK/bf16.jsonl" 1 20 2e-2 || fail "bf16 (fp32 reduce) vs fp32"
compare "$WORK/fp32.jsonl" "$WORK/bf16r.jsonl" 1 20 2e-2 || fail "bf16 (bf16 reduce) vs fp32"
echo "ok: --precision bf16 follows fp32 within 2e-2 for 20 steps, with fp32 and bf16 gradient reduction"

# Checkpoints cross precisions: bf16 to step 10, resumed in fp32 (and the reverse, at 1 rank).
run half1 --precision bf16 --checkpoint-dir "$WORK/ck1" --stop-at-step 10
run half2 --precision fp32 --checkpoint-dir "$WORK/ck1" --resume auto
grep -q "resumed from '.*step_00000010.h5' at step 10" "$WORK/half2.log" || { cat "$WORK/half2.log"; fail "fp32 did not resume the bf16 checkpoint"; }
compare "$WORK/fp32.jsonl" "$WORK/half2.jsonl" 11 20 2e-2 || fail "fp32 resumed from a bf16 checkpoint"
"$BIN" --mode inspect "$WORK/ck1/step_00000010.h5" | grep -q '"precision":"bf16 (fp32 gradient reduce)"' \
  || fail "the bf16 checkpoint does not record its precision"
"$BIN" --mode inspect "$WORK/ck1/step_00000020.h5" | grep -q '"precision":"fp32"' || fail "the fp32 checkpoint does not record its precision"
timeout -k 5 300 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --precision fp32 --checkpoint-dir "$WORK/ck2" --stop-at-step 10 >"$WORK/h3.log" 2>&1 || fail "fp32 first half"
timeout -k 5 300 $MPIRUN -np 1 "$BIN" "${ARGS[@]}" --precision bf16 --checkpoint-dir "$WORK/ck2" --resume auto --metrics "$WORK/half4.jsonl" >"$WORK/h4.log" 2>&1 || { cat "$WORK/h4.log"; fail "bf16 resume at 1 rank"; }
compare "$WORK/fp32.jsonl" "$WORK/half4.jsonl" 11 20 2e-2 || fail "bf16 at 1 rank resumed from an fp32 checkpoint of 2 ranks"
echo "ok: a bf16 checkpoint resumes in fp32, an fp32 checkpoint resumes in bf16 (2 -> 1 ranks)"

# Device refusals (docs/errors.md), before any device is touched.
A2=(--model tiny --data "$DATA" --seq-len 16 --global-batch 4 --steps 2 --threads 1)
expect_fail bad_precision "option '--precision' must be fp32, bf16 or fp8, got 'fp16'" 2 "${A2[@]}" --precision fp16
expect_fail bad_device "option '--device' must be auto, cpu or cuda, got 'gpu'" 2 "${A2[@]}" --device gpu
if [ -e "$(dirname "$BIN")/libshardtrain_cuda.so" ]; then  # a CUDA build: its plugin is beside it
  expect_fail no_gpu "option '--device cuda': no CUDA device visible on node" 2 "${A2[@]}" --device cuda
  # More ranks on a node than GPUs without --gpu-comm mpi (the device count is faked: the rule
  # is checked before any CUDA call, so no GPU is needed to test it).
  # It names the rule, fails on every rank, and leaves the published checkpoints of the run alone.
  sums=$(sha256sum "$WORK"/ck1/*.h5 "$WORK/ck1/latest")
  export SHARDTRAIN_FAKE_CUDA_DEVICES=1
  expect_fail more_ranks_than_gpus "2 ranks run on node $(hostname) but it has only 1 visible CUDA device (2 ranks on GPU 0): NCCL refuses two ranks on one GPU" 2 \
    --model tiny --data "$DATA" --seq-len 32 --global-batch 8 --threads 1 --device cuda --checkpoint-dir "$WORK/ck1" --resume auto --steps 30
  [ "$(sha256sum "$WORK"/ck1/*.h5 "$WORK/ck1/latest")" = "$sums" ] || fail "more_ranks_than_gpus: checkpoints changed"
  expect_fail more_ranks_than_gpus_auto "but it has only 1 visible CUDA device" 2 "${A2[@]}" --device auto
  unset SHARDTRAIN_FAKE_CUDA_DEVICES
else
  expect_fail no_cuda_build "this shardtrain was built without CUDA" 2 "${A2[@]}" --device cuda
fi
echo "ok: device option refusals"

# Ranks started with different options (an MPMD launch, one rank in bf16) must not meet in
# mismatched collectives: one agreed error instead.
rc=0
timeout -k 5 60 $MPIRUN -np 1 "$BIN" "${A2[@]}" --precision bf16 : -np 1 "$BIN" "${A2[@]}" >"$WORK/mpmd.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || { cat "$WORK/mpmd.log"; fail "mpmd: exit status $rc"; }
for r in 0 1; do
  grep -q "error \[rank $r/2\]: the ranks were started with different command-line options" "$WORK/mpmd.log" \
    || { cat "$WORK/mpmd.log"; fail "mpmd: rank $r did not report the mismatch"; }
done
echo "ok: ranks with different options (one in bf16) fail together with one message"
