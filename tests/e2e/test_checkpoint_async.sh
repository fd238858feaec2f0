#!/usr/bin/env bash
# Asynchronous checkpoint saves (issue 29, items 1 and 2; --checkpoint-async on, the default):
#  * the test delay (SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS) makes the background save of step 4
#    last long enough that steps run while it is written: the log shows at least two step lines
#    between "step 4: snapshot taken ... writing in the background" and "saved '.../step_00000004.h5'";
#  * isolation: at W = 1..4, fp32 and bf16, with and without hybrid sharding, the step-4 file of that
#    asynchronous run (written after steps 5.. changed the live tensors: half of the delay comes
#    before the write) equals, in every group, dataset and attribute (tests/e2e/h5_equal.py), the
#    step-4 file of a synchronous run (--checkpoint-async off) stopped at step 4;
#  * kill -9 of one rank while the save of step 8 is in flight (its .tmp written, not published):
#    `latest` still names step 4's complete file, the .tmp (".step_00000008.h5.<host>.<pid>.tmp",
#    rank 0's host and pid) is not read (it is overwritten with junk first), the resumed run removes
#    it with a note (its process is gone), and --resume auto reproduces the uninterrupted run's 12
#    losses bitwise. (tests/e2e/test_checkpoint_tmp_names.sh: live and other hosts' files.)
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
ARGS=(--model tiny --data "$DATA" --seq-len 16 --global-batch 12 --log-every 1 --eval-every 0 --eval-batches 1 --threads 1)
DELAY=1500

# steps_during LOG STEP: the step lines between the start of STEP's background save and its report.
steps_during() {
  awk -v s="$2" -v f="$(printf 'step_%08d.h5' "$2")" '
    $0 ~ "^checkpoint: step " s ": snapshot taken .* writing in the background" { on = 1; next }
    on && /^checkpoint: saved / && index($0, f) { print n + 0; found = 1; exit }
    on && /^step [0-9]+\// { n++ }
    END { if (!found) print -1 }' "$1"
}

# iso NAME NP STEPS EXTRA...: an asynchronous run with checkpoints every 4 steps (the delay on) and a
# synchronous one stopped at step 4; their step-4 files must be equal.
iso() {
  local name=$1 np=$2 steps=$3
  shift 3
  SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS=$DELAY timeout -k 5 120 $MPIRUN -np "$np" "$BIN" "${ARGS[@]}" --steps "$steps" \
    --checkpoint-every 4 --checkpoint-dir "$WORK/$name-a" --metrics "$WORK/$name-a.jsonl" "$@" >"$WORK/$name-a.log" 2>&1 \
    || { cat "$WORK/$name-a.log"; fail "$name: asynchronous run"; }
  grep -q '^checkpoints: asynchronous' "$WORK/$name-a.log" || { cat "$WORK/$name-a.log"; fail "$name: saves not asynchronous"; }
  local n
  n=$(steps_during "$WORK/$name-a.log" 4)
  [ "$n" -ge 2 ] || { cat "$WORK/$name-a.log"; fail "$name: $n step(s) ran during the background save of step 4, expected >= 2"; }
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" "${ARGS[@]}" --steps "$steps" --stop-at-step 4 --checkpoint-async off \
    --checkpoint-dir "$WORK/$name-s" "$@" >"$WORK/$name-s.log" 2>&1 || { cat "$WORK/$name-s.log"; fail "$name: synchronous run"; }
  grep -q '^checkpoints: synchronous' "$WORK/$name-s.log" || { cat "$WORK/$name-s.log"; fail "$name: saves not synchronous"; }
  local cmp
  cmp=$("$PY" "$ROOT/tests/e2e/h5_equal.py" "$WORK/$name-a/step_00000004.h5" "$WORK/$name-s/step_00000004.h5") \
    || { echo "$cmp"; fail "$name: the step-4 file of the asynchronous run differs from the synchronous run's"; }
  echo "ok: $name: $n steps ran during the background save of step 4; its file equals the synchronous one ($cmp)"
}

iso w2-fp32 2 8
grep -m1 "saved '.*step_00000004.h5' .* in the background" "$WORK/w2-fp32-a.log"
iso w1-fp32 1 8
iso w1-bf16 1 8 --precision bf16
iso w2-bf16-g1 2 8 --precision bf16 --shard-group-size 1
iso w3-fp32 3 12
iso w3-bf16-g1 3 8 --precision bf16 --shard-group-size 1
iso w4-fp32-g2 4 8 --shard-group-size 2
iso w4-bf16-g2 4 8 --precision bf16 --shard-group-size 2
iso w4-bf16 4 8 --precision bf16

# kill -9 of rank 2 while the save of step 8 is in flight (same run as w3-fp32, which is the
# uninterrupted reference), once its temporary file exists.
CK=$WORK/kill
SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS=4000 $MPIRUN -np 3 "$BIN" "${ARGS[@]}" --steps 12 --checkpoint-every 4 \
  --checkpoint-dir "$CK" --metrics "$WORK/kill.jsonl" >"$WORK/kill.log" 2>&1 &
JOB=$!
TMP=
for _ in $(seq 1 600); do
  TMP=$(compgen -G "$CK/.step_00000008.h5.*.tmp") && break
  sleep 0.05
done
[ -n "$TMP" ] || { kill -9 $JOB; cat "$WORK/kill.log"; fail "kill -9: the save of step 8 never started"; }
TMP=${TMP##*/}
RANK0=${TMP%.tmp}
RANK0=${RANK0##*.}  # rank 0's process id, from the temporary name
pgrep -P $JOB | grep -qx "$RANK0" || fail "kill -9: '$TMP' does not name a rank of the job (its ranks: $(pgrep -P $JOB | xargs))"
sleep 0.3  # into the second half of the delay: the .tmp is written, not published
[ ! -e "$CK/step_00000008.h5" ] || fail "kill -9: step 8 already published (the delay is too short on this machine)"
kill -9 "$(pgrep -P $JOB | sed -n 3p)"
RC=0
timeout 60 tail --pid=$JOB -f /dev/null || fail "kill -9: the job did not end within 60 s"
wait $JOB || RC=$?
[ "$RC" -ne 0 ] || fail "kill -9: exit status 0"
[ "$(cat "$CK/latest")" = "step_00000004.h5" ] || fail "kill -9: latest is '$(cat "$CK/latest")', expected step_00000004.h5"
"$PY" "$ROOT/tests/e2e/ckpt_meta.py" verify "$CK/step_00000004.h5" >/dev/null || fail "kill -9: step 4's checkpoint is not complete"
[ -e "$CK/$TMP" ] && [ ! -e "$CK/step_00000008.h5" ] || { ls -la "$CK"; fail "kill -9: expected an unpublished $TMP"; }
for _ in $(seq 1 100); do kill -0 "$RANK0" 2>/dev/null || break; sleep 0.1; done
echo "junk, not HDF5: reading this file is a bug" >"$CK/$TMP"
timeout -k 5 120 $MPIRUN -np 3 "$BIN" "${ARGS[@]}" --steps 12 --checkpoint-every 4 --checkpoint-dir "$CK" --resume auto \
  --metrics "$WORK/kill.jsonl" >"$WORK/kill-resume.log" 2>&1 || { cat "$WORK/kill-resume.log"; fail "kill -9: resume"; }
grep -q "resumed from '$CK/step_00000004.h5' at step 4" "$WORK/kill-resume.log" || { cat "$WORK/kill-resume.log"; fail "kill -9: did not resume from step 4"; }
[ "$(losses "$WORK/kill.jsonl" | wc -l)" -eq 12 ] || fail "kill -9: the resumed metrics do not hold 12 losses"
diff <(losses "$WORK/w3-fp32-a.jsonl") <(losses "$WORK/kill.jsonl") || fail "kill -9: resumed losses differ from the uninterrupted run's"
[ "$(cat "$CK/latest")" = "step_00000012.h5" ] || fail "kill -9: latest is not step 12 after the resumed run"
grep -qF "note: removed '$TMP' in '$CK': a temporary file of an interrupted save; process $RANK0 on " "$WORK/kill-resume.log" \
  || { cat "$WORK/kill-resume.log"; fail "kill -9: the resumed run did not remove '$TMP' with a note"; }
[ ! -e "$CK/$TMP" ] && ! ls -a "$CK" | grep -q '\.tmp$' || { ls -la "$CK"; fail "kill -9: a temporary file is left after the resumed run"; }
echo "ok: kill -9 of rank 2 during the background save of step 8 (exit $RC): latest -> step_00000004.h5 (complete), '$TMP' unread and removed at the resume; resumed, 12 losses bitwise equal to the uninterrupted run"

# SIGUSR1 while the save of step 4 is in flight: the preemption save waits for it (published), then
# saves its own step; exit 75.
CK=$WORK/usr1
SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS=2000 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --steps 400 --checkpoint-every 4 \
  --checkpoint-dir "$CK" >"$WORK/usr1.log" 2>&1 &
JOB=$!
for _ in $(seq 1 600); do
  grep -q '^checkpoint: step 4: snapshot taken' "$WORK/usr1.log" && break
  sleep 0.05
done
kill -USR1 "$(pgrep -P $JOB | sed -n 2p)"
RC=0
timeout 60 tail --pid=$JOB -f /dev/null || fail "SIGUSR1: the job did not end within 60 s"
wait $JOB || RC=$?
[ "$RC" -eq 75 ] || { cat "$WORK/usr1.log"; fail "SIGUSR1 during a background save: exit status $RC, expected 75"; }
K=$(sed -n 's/^step_0*\([0-9]*\)\.h5$/\1/p' "$CK/latest")
[ -n "$K" ] && [ "$K" -gt 4 ] && [ -f "$CK/step_00000004.h5" ] || { ls -la "$CK"; cat "$WORK/usr1.log"; fail "SIGUSR1: latest '$(cat "$CK/latest")', step 4 $(ls "$CK")"; }
"$PY" "$ROOT/tests/e2e/ckpt_meta.py" verify "$CK/step_$(printf %08d "$K").h5" >/dev/null || fail "SIGUSR1: step $K's checkpoint is not complete"
! ls -a "$CK" | grep -q '\.tmp$' || { ls -la "$CK"; fail "SIGUSR1: a temporary file was left"; }
echo "ok: SIGUSR1 during the background save of step 4: it was published, then step $K saved; exit 75"

# A background save that fails (the checkpoint directory replaced by a file after the setup checked
# it): every rank stops at one step boundary with the save's error, exit non-zero.
CK=$WORK/fails
$MPIRUN -np 3 "$BIN" "${ARGS[@]}" --steps 2000 --checkpoint-every 300 --checkpoint-dir "$CK" >"$WORK/fails.log" 2>&1 &
JOB=$!
for _ in $(seq 1 600); do
  grep -q '^step 5/' "$WORK/fails.log" && break
  sleep 0.05
done
mv "$CK" "$CK.moved" && echo "not a directory" >"$CK"
RC=0
timeout 60 tail --pid=$JOB -f /dev/null || fail "failed background save: the job did not end within 60 s"
wait $JOB || RC=$?
[ "$RC" -ne 0 ] || { cat "$WORK/fails.log"; fail "failed background save: exit status 0"; }
grep -q '^step 300/' "$WORK/fails.log" || { cat "$WORK/fails.log"; fail "failed background save: it stopped before step 300"; }
for r in 0 1 2; do
  grep -q "error \[rank $r/3\]: cannot create checkpoint directory '$CK' .*(checkpoint of step 300, written in the background; training stopped after step [0-9]*)" "$WORK/fails.log" \
    || { cat "$WORK/fails.log"; fail "failed background save: rank $r did not report the save's error"; }
done
STOPS=$(grep -o 'training stopped after step [0-9]*' "$WORK/fails.log" | sort -u)
[ "$(echo "$STOPS" | wc -l)" -eq 1 ] || fail "failed background save: ranks stopped at different steps: $STOPS"
grep -q "^step ${STOPS##* }/" "$WORK/fails.log" || fail "failed background save: no log line of step ${STOPS##* }"
echo "ok: a failed background save of step 300: all 3 ranks stopped after step ${STOPS##* } with its error (exit $RC)"
