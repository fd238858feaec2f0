#!/usr/bin/env bash
# Exact resume and resharding.
#  * W=2: stop at step 10, resume: steps 11-20 bit-for-bit equal to the run that never stopped.
#  * Resharding 4 -> 3 -> 1: saved at 4 ranks after step 10, resumed at 3 to step 15 (saved), then
#    resumed at 1 to step 20: every loss within 1e-5 relative of the uninterrupted 4-rank run.
# Model test-uneven: all units uneven over 3 and 4 ranks.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
ARGS=(--model test-uneven --data "$DATA" --seq-len 32 --global-batch 12 --steps 20 --lr 3e-3 --warmup 5
  --log-every 1 --eval-every 0 --eval-batches 1 --threads 1)
run() {  # np log args...
  local np=$1 log=$2
  shift 2
  timeout -k 5 300 $MPIRUN -np "$np" "$BIN" "${ARGS[@]}" "$@" >"$WORK/$log" 2>&1 || { cat "$WORK/$log"; fail "run $log failed"; }
}

# Bitwise exact resume at W=2.
run 2 ref2.log --metrics "$WORK/ref2.jsonl"
run 2 a1.log --metrics "$WORK/a.jsonl" --checkpoint-dir "$WORK/ck2" --stop-at-step 10
[ "$(cat "$WORK/ck2/latest")" = "step_00000010.h5" ] || fail "latest does not name step 10"
run 2 a2.log --metrics "$WORK/a.jsonl" --checkpoint-dir "$WORK/ck2" --resume auto
grep -q "resumed from '$WORK/ck2/step_00000010.h5' at step 10 (saved at world size 2)" "$WORK/a2.log" || fail "no resume line"
diff <(losses "$WORK/ref2.jsonl") <(losses "$WORK/a.jsonl") || fail "W=2 resume is not bitwise equal to the uninterrupted run"
[ "$(losses "$WORK/a.jsonl" | wc -l)" -eq 20 ] || fail "expected 20 losses"
echo "ok: stop at 10 + resume at W=2: 20 losses bitwise equal to the uninterrupted run"

# Resharding 4 -> 3 -> 1.
run 4 ref4.log --metrics "$WORK/ref4.jsonl"
run 4 b1.log --metrics "$WORK/b.jsonl" --checkpoint-dir "$WORK/ck" --stop-at-step 10
run 3 b2.log --metrics "$WORK/b.jsonl" --checkpoint-dir "$WORK/ck" --resume auto --stop-at-step 15
grep -q "(saved at world size 4)" "$WORK/b2.log" || fail "3-rank run did not load the 4-rank checkpoint"
run 1 b3.log --metrics "$WORK/b.jsonl" --checkpoint-dir "$WORK/ck" --resume auto
grep -q "(saved at world size 3)" "$WORK/b3.log" || fail "1-rank run did not load the 3-rank checkpoint"
"$PY" - "$WORK/ref4.jsonl" "$WORK/b.jsonl" <<'PY'
import json, sys
ref, got = ([json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in sys.argv[1:3])
assert len(ref) == len(got) == 20, (len(ref), len(got))
worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
assert worst <= 1e-5, f"resharded run deviates: worst relative difference {worst:.2e}"
assert ref[:10] == got[:10], "the first 10 steps at 4 ranks must be identical"
print(f"ok: resharded 4 -> 3 (step 10) -> 1 (step 15): 20 losses within {worst:.1e} of the uninterrupted run")
PY
