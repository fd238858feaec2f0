#!/usr/bin/env bash
# Preemption and failures (issue 6):
#  * SIGUSR1 (Slurm's --signal=USR1@T) to ONE rank of a 3-rank job: every rank finishes the step,
#    the checkpoint is published, the job exits 75; --resume auto continues the same loss curve
#    (bitwise: same world size).
#  * SIGTERM to rank 0: same exit status, checkpoint published.
#  * kill -9 of one rank: the job ends well within 60 s; the last published checkpoint loads.
#  * a rank that hangs (SIGSTOP): the others' collective watchdog ends the job, naming the stuck collective.
#  * --skip-nonfinite: a diverging run skips its non-finite steps instead of stopping.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
ARGS=(--model tiny --data "$DATA" --seq-len 32 --global-batch 6 --steps 400 --log-every 1 --eval-every 0
  --eval-batches 1 --threads 1)

start_job() {  # log args... ; sets JOB (mpirun pid)
  local log=$1
  shift
  $MPIRUN -np 3 "$BIN" "${ARGS[@]}" "$@" >"$WORK/$log" 2>&1 &
  JOB=$!
}
rank_pids() { pgrep -P "$JOB" || true; }  # mpirun's children are the ranks, in rank order
wait_steps() {  # metrics-file n: wait until n steps are logged
  for _ in $(seq 1 600); do
    [ -f "$1" ] && [ "$(grep -c '"loss"' "$1")" -ge "$2" ] && return 0
    sleep 0.1
  done
  fail "no progress in $1"
}
wait_job() {  # seconds ; sets RC, ELAPSED
  local t0=$SECONDS
  RC=0
  for _ in $(seq 1 $(($1 * 10))); do
    kill -0 "$JOB" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$JOB" 2>/dev/null && { kill -9 "$JOB"; fail "job still running after $1 s (hang)"; }
  wait "$JOB" || RC=$?
  ELAPSED=$((SECONDS - t0))
}

timeout -k 5 300 $MPIRUN -np 3 "$BIN" "${ARGS[@]}" --metrics "$WORK/ref.jsonl" >"$WORK/ref.log" 2>&1 || { cat "$WORK/ref.log"; fail "reference run"; }

# SIGUSR1 to rank 1 only.
start_job usr1.log --checkpoint-dir "$WORK/ck" --metrics "$WORK/a.jsonl"
wait_steps "$WORK/a.jsonl" 5
kill -USR1 "$(rank_pids | sed -n 2p)"
wait_job 60
[ "$RC" -eq 75 ] || { cat "$WORK/usr1.log"; fail "SIGUSR1: exit status $RC, expected 75"; }
grep -q "stop requested by a signal" "$WORK/usr1.log" || fail "SIGUSR1: no stop message"
K=$(sed -n 's/^step_0*\([0-9]*\)\.h5$/\1/p' "$WORK/ck/latest")
[ -n "$K" ] && [ "$K" -ge 5 ] && [ "$K" -lt 400 ] || fail "SIGUSR1: latest is '$(cat "$WORK/ck/latest")'"
[ "$(grep -c '"loss"' "$WORK/a.jsonl")" -eq "$K" ] || fail "SIGUSR1: metrics do not stop at the saved step $K"
echo "ok: SIGUSR1 to one of 3 ranks: all stopped after step $K, checkpoint published, exit status 75"
timeout -k 5 300 $MPIRUN -np 3 "$BIN" "${ARGS[@]}" --checkpoint-dir "$WORK/ck" --resume auto --metrics "$WORK/a.jsonl" \
  >"$WORK/resume.log" 2>&1 || { cat "$WORK/resume.log"; fail "resume after SIGUSR1"; }
diff <(losses "$WORK/ref.jsonl") <(losses "$WORK/a.jsonl") >/dev/null || fail "resumed loss curve differs from the uninterrupted run"
echo "ok: --resume auto continued to step 400; all 400 losses bitwise equal to the uninterrupted run"

# SIGTERM to rank 0.
start_job term.log --checkpoint-dir "$WORK/ck2" --metrics "$WORK/b.jsonl"
wait_steps "$WORK/b.jsonl" 5
kill -TERM "$(rank_pids | sed -n 1p)"
wait_job 60
[ "$RC" -eq 75 ] && [ -f "$WORK/ck2/latest" ] || { cat "$WORK/term.log"; fail "SIGTERM: exit $RC, latest $(cat "$WORK/ck2/latest" 2>/dev/null)"; }
echo "ok: SIGTERM to rank 0: checkpoint $(cat "$WORK/ck2/latest") published, exit status 75"

# kill -9 of one rank.
start_job kill.log --checkpoint-dir "$WORK/ck3" --checkpoint-every 5 --metrics "$WORK/c.jsonl"
wait_steps "$WORK/c.jsonl" 12
kill -9 "$(rank_pids | sed -n 3p)"
wait_job 60
[ "$RC" -ne 0 ] || fail "kill -9: exit status 0"
grep -q "rank 2" "$WORK/kill.log" || { cat "$WORK/kill.log"; fail "kill -9: the failed rank is not named"; }
K3=$(sed -n 's/^step_0*\([0-9]*\)\.h5$/\1/p' "$WORK/ck3/latest")
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --checkpoint-dir "$WORK/ck3" --resume auto --stop-at-step $((K3 + 1)) \
  >"$WORK/kill-resume.log" 2>&1 || { cat "$WORK/kill-resume.log"; fail "kill -9: last checkpoint does not load"; }
echo "ok: kill -9 of rank 2: job ended in ${ELAPSED} s (exit $RC), $(grep -o "resumed from '[^']*'" "$WORK/kill-resume.log") at 2 ranks"

# A hung rank: the watchdog of the others ends the job.
start_job stop.log --collective-timeout 5 --metrics "$WORK/d.jsonl"
wait_steps "$WORK/d.jsonl" 5
STOPPED=$(rank_pids | sed -n 2p)
kill -STOP "$STOPPED"
wait_job 60
kill -CONT "$STOPPED" 2>/dev/null || true
[ "$RC" -eq 70 ] || { cat "$WORK/stop.log"; fail "hung rank: exit status $RC, expected 70"; }
grep -q "has not completed after [0-9]* s: another rank is dead or stuck" "$WORK/stop.log" || fail "hung rank: no watchdog message"
echo "ok: a stopped rank: the others' watchdog ended the job in ${ELAPSED} s with exit status 70"

# --skip-nonfinite.
timeout -k 5 120 $MPIRUN -np 2 "$BIN" --model tiny --data "$DATA" --seq-len 16 --global-batch 4 --threads 1 --steps 6 \
  --lr 1e30 --clip 0 --skip-nonfinite --eval-batches 1 >"$WORK/skip.log" 2>&1 || { cat "$WORK/skip.log"; fail "--skip-nonfinite run failed"; }
grep -q "update skipped (--skip-nonfinite)" "$WORK/skip.log" || fail "--skip-nonfinite: no skipped step"
echo "ok: --skip-nonfinite skipped $(grep -c 'update skipped' "$WORK/skip.log") non-finite steps and finished"
