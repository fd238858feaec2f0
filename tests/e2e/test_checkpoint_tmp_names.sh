#!/usr/bin/env bash
# The checkpoint directory's temporary names (issue 39; checkpoint.h "Temporary files",
# docs/checkpoint-format.md "Directory"):
#  * kill -9 of rank 0 while the background save of step 8 is in flight leaves exactly
#    ".step_00000008.h5.<host>.<pid>.tmp" and "latest.<host>.<pid>.tmp", <pid> rank 0's process id
#    and <host> this machine's host name;
#  * beside them the test plants a live job's files (tagged with the pid of a `sleep` it started),
#    a dead process's directory probe, another host's file (with the dead pid: the host decides)
#    and an earlier version's untagged "latest.tmp"; the resumed run removes the dead process's
#    three files with a note naming each, leaves the other four byte for byte with a note each, and
#    trains on: resumed from step 4, the 12 losses bitwise equal to an uninterrupted run's, steps 8
#    and 12 published and complete, none of its own temporary files left;
#  * once the `sleep` is gone, the next run removes that job's two files too.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
ARGS=(--model tiny --data "$DATA" --seq-len 16 --global-batch 12 --log-every 1 --eval-every 0 --eval-batches 1 --threads 1
  --checkpoint-every 4)
host=$(hostname | tr -c 'A-Za-z0-9.\n-' '-')
SLEEP=
# is_listing DIR NAME...: DIR holds exactly these names (hidden ones included), besides the lock file
# every training run leaves there (CheckpointDirLock: it stays, its flock goes with the process).
is_listing() {
  local d=$1
  shift
  [ "$(LC_ALL=C ls -A "$d" | grep -vx '\.shardtrain\.lock' | xargs)" = "$(printf '%s\n' "$@" | LC_ALL=C sort | xargs)" ]
}
trap '[ -z "$SLEEP" ] || kill "$SLEEP" 2>/dev/null || true; rm -rf "$WORK"' EXIT

# The uninterrupted reference; a fresh directory has nothing to report.
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --steps 12 --checkpoint-dir "$WORK/ref" --metrics "$WORK/ref.jsonl" \
  >"$WORK/ref.log" 2>&1 || { cat "$WORK/ref.log"; fail "reference run"; }
! grep -q "^note: \(removed\|left\|could not\)" "$WORK/ref.log" || { cat "$WORK/ref.log"; fail "a fresh directory gave notes"; }

CK=$WORK/ck
SHARDTRAIN_TEST_CHECKPOINT_WRITE_DELAY_MS=4000 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --steps 12 --checkpoint-dir "$CK" \
  --metrics "$WORK/run.jsonl" >"$WORK/kill.log" 2>&1 &
JOB=$!
TMP=
for _ in $(seq 1 600); do
  TMP=$(cd "$CK" 2>/dev/null && compgen -G ".step_00000008.h5.*.tmp") && break
  sleep 0.05
done
[ -n "$TMP" ] || { kill -9 $JOB; cat "$WORK/kill.log"; fail "the save of step 8 never started"; }
[[ $TMP =~ ^\.step_00000008\.h5\.(($host(_pidns[0-9]+)?)\.([1-9][0-9]*))\.tmp$ ]] ||
  { kill -9 $JOB; fail "temporary name '$TMP' is not '.step_00000008.h5.$host.<pid>.tmp'"; }
TAG=${BASH_REMATCH[1]} HOSTP=${BASH_REMATCH[2]} RANK0=${BASH_REMATCH[4]}
RANKS=$(pgrep -P $JOB | xargs)
[[ " $RANKS " == *" $RANK0 "* ]] || { kill -9 $JOB; fail "'$TMP' names pid $RANK0, not a rank of the job ($RANKS)"; }
sleep 0.3  # into the second half of the delay: the file is written, not published
[ ! -e "$CK/step_00000008.h5" ] || { kill -9 $JOB; fail "step 8 already published (the delay is too short on this machine)"; }
kill -9 "$RANK0"
RC=0
timeout 60 tail --pid=$JOB -f /dev/null || fail "the job did not end within 60 s of kill -9"
wait $JOB || RC=$?
[ "$RC" -ne 0 ] || fail "exit status 0 after kill -9 of rank 0"
for _ in $(seq 1 100); do kill -0 "$RANK0" 2>/dev/null || break; sleep 0.1; done
! kill -0 "$RANK0" 2>/dev/null || fail "rank 0 (pid $RANK0) still runs 10 s after the job ended"
is_listing "$CK" "$TMP" latest "latest.$TAG.tmp" step_00000004.h5 ||
  { ls -la "$CK"; fail "after kill -9: expected step 4, latest, '$TMP' and 'latest.$TAG.tmp'"; }
[ "$(cat "$CK/latest")" = "step_00000004.h5" ] && [ "$(cat "$CK/latest.$TAG.tmp")" = "step_00000008.h5" ] ||
  fail "after kill -9: latest '$(cat "$CK/latest")', latest.$TAG.tmp '$(cat "$CK/latest.$TAG.tmp")'"
echo "ok: kill -9 of rank 0 (pid $RANK0) during the background save of step 8 (exit $RC) left '$TMP' and 'latest.$TAG.tmp'"

# Plant the other kinds. The dead run's file is overwritten with junk: it must not be read.
sleep 60 &
SLEEP=$!
LIVE=$HOSTP.$SLEEP
OTHER=.step_00000008.h5.other-node.example.$RANK0.tmp
echo "junk, not HDF5: reading this file is a bug" >"$CK/$TMP"
echo "live job's checkpoint" >"$CK/.step_00000012.h5.$LIVE.tmp"
echo "step_00000012.h5" >"$CK/latest.$LIVE.tmp"
echo "$TAG.99" >"$CK/.shardtrain-probe-$TAG.99"
echo "other host's checkpoint" >"$CK/$OTHER"
echo "step_00000006.h5" >"$CK/latest.tmp"
KEPT=(".step_00000012.h5.$LIVE.tmp" "latest.$LIVE.tmp" "$OTHER" "latest.tmp")
sums=$(cd "$CK" && sha256sum "${KEPT[@]}")

timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --steps 12 --checkpoint-dir "$CK" --resume auto \
  --metrics "$WORK/run.jsonl" >"$WORK/resume.log" 2>&1 || { cat "$WORK/resume.log"; fail "resume"; }
want() { grep -qxF "$1" "$WORK/resume.log" || { cat "$WORK/resume.log"; fail "the resumed run's log lacks the line: $1"; }; }
for f in "$TMP" "latest.$TAG.tmp" ".shardtrain-probe-$TAG.99"; do
  want "note: removed '$f' in '$CK': a temporary file of an interrupted save; process $RANK0 on $HOSTP is gone"
done
for f in ".step_00000012.h5.$LIVE.tmp" "latest.$LIVE.tmp"; do
  want "note: left '$f' in '$CK': process $SLEEP on $HOSTP is alive (a save of another job, or a process id used again since its writer died)"
done
want "note: left '$OTHER' in '$CK': a temporary file of process $RANK0 of host other-node.example: not checked from here"
want "note: left 'latest.tmp' in '$CK': a temporary file of an earlier shardtrain version, which names no process: not removed (remove it once no job of an earlier version writes to this directory)"
[ "$(grep -c "^note: \(removed\|left\|could not\)" "$WORK/resume.log")" -eq 7 ] || { cat "$WORK/resume.log"; fail "expected 7 notes on temporary files"; }
grep -q "resumed from '$CK/step_00000004.h5' at step 4" "$WORK/resume.log" || { cat "$WORK/resume.log"; fail "did not resume from step 4"; }
[ "$(cd "$CK" && sha256sum "${KEPT[@]}")" = "$sums" ] || fail "a file that is not the dead process's changed"
is_listing "$CK" "${KEPT[@]}" latest step_00000004.h5 step_00000008.h5 step_00000012.h5 ||
  { ls -la "$CK"; fail "after the resumed run: unexpected files"; }
[ "$(cat "$CK/latest")" = "step_00000012.h5" ] || fail "latest is '$(cat "$CK/latest")' after the resumed run"
for s in 8 12; do
  "$PY" "$ROOT/tests/e2e/ckpt_meta.py" verify "$CK/step_$(printf %08d $s).h5" >/dev/null || fail "step $s's checkpoint is not complete"
done
[ "$(losses "$WORK/run.jsonl" | wc -l)" -eq 12 ] || fail "the resumed metrics do not hold 12 losses"
diff <(losses "$WORK/ref.jsonl") <(losses "$WORK/run.jsonl") || fail "the resumed losses differ from the uninterrupted run's"
grep "^note: \(removed\|left\)" "$WORK/resume.log" | cut -c1-160
echo "ok: resumed at step 4: the dead rank 0's 3 files removed, the live job's 2, another host's and an earlier version's left unchanged (7 notes); 12 losses bitwise equal to the uninterrupted run; steps 8 and 12 complete"

# The `sleep` is gone now: the next run removes its files; the rest is reported again.
kill "$SLEEP"
wait "$SLEEP" 2>/dev/null || true
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --steps 16 --accept-change steps --checkpoint-dir "$CK" --resume auto \
  >"$WORK/again.log" 2>&1 || { cat "$WORK/again.log"; fail "the run after the sleep ended"; }
for f in ".step_00000012.h5.$LIVE.tmp" "latest.$LIVE.tmp"; do
  grep -qxF "note: removed '$f' in '$CK': a temporary file of an interrupted save; process $SLEEP on $HOSTP is gone" "$WORK/again.log" ||
    { cat "$WORK/again.log"; fail "'$f' was not removed once process $SLEEP was gone"; }
done
[ "$(grep -c "^note: left" "$WORK/again.log")" -eq 2 ] || { cat "$WORK/again.log"; fail "expected 2 files left"; }
is_listing "$CK" "$OTHER" latest latest.tmp step_00000004.h5 step_00000008.h5 step_00000012.h5 step_00000016.h5 ||
  { ls -la "$CK"; fail "after the sleep ended: unexpected files"; }
echo "ok: once process $SLEEP ended, the next run removed its 2 files; another host's and the earlier version's are left"
