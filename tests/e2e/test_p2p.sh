#!/usr/bin/env bash
# Point-to-point on Comm (runtime.h) at world sizes make test's mpi groups do not reach, and its
# watchdog (issue 40):
#  * the P2p tests of mpi_tests (ring shift at every group size 1..W, send/receive by tag and
#    order, the ring shift advanced during GEMMs and attention by the progress registry) at 5 and 6
#    ranks (make test runs them at 1..4);
#  * a peer that never starts its side of a ring shift (it waits on a receive nobody sends): every
#    rank ends by its own collective watchdog (each of the W ranks prints the watchdog's message and
#    exits with status 70; mpirun told not to end the others first), within 60 s, at 2 and 3 ranks;
#  * a peer that hangs (SIGSTOP) before its side: the others' watchdogs end the job (exit 70).
source "$(dirname "$0")/common.sh"
T=$(realpath "$BUILD/mpi_tests")

# Every enabled P2p case must pass (its count from the binary's own list).
want=$($MPIRUN -np 1 "$T" --gtest_list_tests --gtest_filter='P2p.*' 2>/dev/null | grep -E '^  [A-Za-z]' | grep -vc '^  DISABLED_')
[ "$want" -ge 6 ] || fail "mpi_tests lists $want P2p cases"
for np in 5 6; do
  log=$WORK/p2p-np$np.log
  timeout -k 5 300 $MPIRUN -np "$np" "$T" --gtest_filter='P2p.*' --gtest_color=no >"$log" 2>&1 ||
    { cat "$log"; fail "P2p tests at $np ranks"; }
  grep -q "^\[  PASSED  \] $want tests" "$log" || { cat "$log"; fail "P2p tests at $np ranks: not $want passed"; }
  echo "ok: P2p tests at $np ranks ($(grep -m1 'ring shift of 4 MB.*GEMMs' "$log" | sed 's/^\[ info \] //'))"
done

dead_peer() {  # mode np extra-mpirun-args... ; sets RC, ELAPSED, LOG
  local mode=$1 np=$2
  shift 2
  LOG=$WORK/dead-$mode-np$np.log
  local t0=$SECONDS
  RC=0
  # Each rank under a shell that reports the rank's own exit status.
  SHARDTRAIN_TEST_P2P_PEER=$mode timeout -k 5 60 $MPIRUN -np "$np" -x SHARDTRAIN_TEST_P2P_PEER "$@" bash -c \
    '"$0" --gtest_also_run_disabled_tests --gtest_filter=P2p.DISABLED_DeadPeerEndsEveryRankUnderWatchdog \
       --gtest_color=no; rc=$?; echo "rank $OMPI_COMM_WORLD_RANK exit status $rc"; exit $rc' "$T" >"$LOG" 2>&1 || RC=$?
  ELAPSED=$((SECONDS - t0))
  [ "$RC" -ne 124 ] && [ "$RC" -ne 137 ] || { cat "$LOG"; fail "$mode peer at $np ranks: hang (timed out)"; }
  ! grep -q "got past a transfer" "$LOG" || { cat "$LOG"; fail "$mode peer at $np ranks: a rank got past the transfer"; }
}
msg="has not completed after [0-9]* s: another rank is dead or stuck"

for np in 2 3; do
  dead_peer silent "$np" --mca orte_abort_on_non_zero_status 0
  for ((r = 0; r < np; r++)); do
    grep -q "error \[rank $r/$np\]: collective .*$msg" "$LOG" || { cat "$LOG"; fail "silent peer at $np ranks: rank $r has no watchdog message"; }
    grep -q "^rank $r exit status 70$" "$LOG" || { cat "$LOG"; fail "silent peer at $np ranks: rank $r did not exit with status 70"; }
  done
  echo "ok: a peer that never sends, $np ranks: every rank's watchdog ended it in ${ELAPSED} s, exit 70 ($(grep -o 'collective [a-z_]* *([a-z]*)\|collective [a-z_]*' "$LOG" | sort | uniq -c | tr -s ' ' | paste -sd, -))"
done

dead_peer stopped 3
[ "$RC" -eq 70 ] || { cat "$LOG"; fail "stopped peer: exit status $RC, expected 70"; }
grep -q "$msg" "$LOG" || { cat "$LOG"; fail "stopped peer: no watchdog message"; }
echo "ok: a stopped peer, 3 ranks: the others' watchdog ended the job in ${ELAPSED} s, exit 70"
