#!/usr/bin/env bash
# --tensorboard DIR (issue 30 item 1), read back with TensorBoard's own EventAccumulator (tb_check.py):
#  * a 2-rank run: one event file (rank 0's: another rank writing would make a second); every tag, step and value of the
#    --metrics file (float32), nothing else;
#  * a crash before publishing step 6 (checkpoints every 3) and a resume: TensorBoard shows each step
#    once (the new file's START event at step 4 drops the crashed run's steps 4-6), with the values of
#    the uninterrupted run, bitwise as float32;
#  * a fresh run into that directory: a note, and TensorBoard shows only the new run's steps;
#  * a --tensorboard path that is a file: refused on every rank, naming the option.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
CHECK="$PY $ROOT/tests/e2e/tb_check.py"
B=(--model tiny --data "$DATA" --seq-len 16 --global-batch 6 --log-every 1 --eval-batches 1 --threads 1)
M=("${B[@]}" --steps 8 --eval-every 2)
run() {  # log np args...
  local log=$1 np=$2
  shift 2
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" "$@" >"$WORK/$log" 2>&1 || { cat "$WORK/$log"; fail "run $log"; }
}

# --- an uninterrupted 2-rank run ----------------------------------------------------------------
run ref.log 2 "${M[@]}" --metrics "$WORK/ref.jsonl" --tensorboard "$WORK/tb-ref"
$CHECK "$WORK/tb-ref" "$WORK/ref.jsonl" --files 1 || fail "uninterrupted run"
f=$(ls "$WORK/tb-ref")
grep -qF "tensorboard: writing '$WORK/tb-ref/$f'" "$WORK/ref.log" || { cat "$WORK/ref.log"; fail "no line naming $f"; }

# --- crash after the save of step 3, before publishing step 6; resume ----------------------------
rc=0
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${M[@]}" --checkpoint-dir "$WORK/c" --checkpoint-every 3 --debug-crash-before-publish 6 \
  --metrics "$WORK/c.jsonl" --tensorboard "$WORK/tb-c" >"$WORK/crash.log" 2>&1 || rc=$?
[ "$rc" = 86 ] || { cat "$WORK/crash.log"; fail "crash run: exit status $rc"; }
run resume.log 2 "${M[@]}" --checkpoint-dir "$WORK/c" --resume auto --metrics "$WORK/c.jsonl" --tensorboard "$WORK/tb-c"
grep -q "tensorboard: '$WORK/tb-c' already holds 1 event file(s); this run starts at step 4" "$WORK/resume.log" \
  || { cat "$WORK/resume.log"; fail "no note about the earlier event file"; }
$CHECK "$WORK/tb-c" "$WORK/c.jsonl" --files 2 --raw-steps-over 3 || fail "crash and resume"
# The resumed run's TensorBoard values are the uninterrupted run's (2 ranks both: bitwise).
"$PY" - "$WORK/ref.jsonl" "$WORK/tb-c" <<'PY' || fail "resumed values differ from the uninterrupted run's"
import json, sys
import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator, SCALARS
ref = {}
for l in open(sys.argv[1]):
    r = json.loads(l)
    for k, t in (("loss", "train/loss"), ("val_loss", "val/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm")):
        if k in r:
            ref[(t, r["step"])] = float(np.float32(r[k]))
acc = EventAccumulator(sys.argv[2], size_guidance={SCALARS: 0})
acc.Reload()
got = {(t, e.step): e.value for t in ("train/loss", "val/loss", "train/lr", "train/grad_norm") for e in acc.Scalars(t)}
assert got == ref, sorted(set(got.items()) ^ set(ref.items()))[:6]
print(f"ok: after crash and resume TensorBoard's loss, val loss, lr and grad norm ({len(got)} points) are the "
      "uninterrupted run's, bitwise")
PY

# --- a fresh run into a used directory -----------------------------------------------------------
run fresh.log 2 "${B[@]}" --steps 4 --eval-every 0 --metrics "$WORK/fresh.jsonl" --tensorboard "$WORK/tb-ref"
grep -q "already holds 1 event file(s); this run starts at step 1 .*(all of them: a fresh run" "$WORK/fresh.log" \
  || { cat "$WORK/fresh.log"; fail "no note for a fresh run into a used directory"; }
$CHECK "$WORK/tb-ref" "$WORK/fresh.jsonl" --files 2 || fail "fresh run into a used directory"

# --- a --tensorboard path that is a file ---------------------------------------------------------
touch "$WORK/plain"
expect_fail tb-is-a-file "cannot create TensorBoard directory '$WORK/plain' (option '--tensorboard')" 2 \
  "${B[@]}" --steps 1 --tensorboard "$WORK/plain"
echo "ok: test_tensorboard"
