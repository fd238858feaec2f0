#!/usr/bin/env bash
# Fatal signals (issue 39, part 2): a real fault injected by the test hook
# SHARDTRAIN_TEST_FATAL_SIGNAL=WHAT[:RANK][:pre] (docs/errors.md) under mpirun -np 2. The faulting rank
# prints "shardtrain: fatal [rank R/2] SIG..." with the fault address and its thread's backtrace,
# whose frames name the shardtrain function that faulted (symbolized: the binary is linked
# -rdynamic), then dies by the same signal (mpirun: "exited on signal N"), and the job exits non-zero
# within the timeout. Open MPI's own handler ("*** Process received signal ***") stays out: ours is
# installed before MPI_Init. Cases: SIGSEGV after MPI_Init on rank 1; before MPI_Init on rank 0 (the
# rank from the launcher's environment); a call through a null function pointer (the fault at address
# 0 with no frame of its own: the report starts at its caller), and through a dangling one; SIGBUS, SIGFPE, SIGILL; a stack
# overflow (reported from the alternate signal stack); a malformed hook value is ignored.
source "$(dirname "$0")/common.sh"

# fault NAME HOOK RANK SIGNUM SIGNAME FUNCTION [GREP...]: mpirun -np 2 --help with the hook set; rank
# RANK must report SIGNAME with a frame of FUNCTION (shardtrain::FUNCTION, mangled) and die by SIGNUM;
# every further argument is a pattern the output must also hold.
fault() {
  local name=$1 hook=$2 rank=$3 signum=$4 sig=$5 fn=$6
  shift 6
  local log=$WORK/$name.log rc=0
  SHARDTRAIN_TEST_FATAL_SIGNAL=$hook timeout -k 5 60 $MPIRUN -np 2 -x SHARDTRAIN_TEST_FATAL_SIGNAL "$BIN" --help \
    >"$log" 2>&1 || rc=$?
  [ "$rc" -ne 124 ] || { cat "$log"; fail "$name: timed out (a hang after the fault)"; }
  [ "$rc" -ne 0 ] || { cat "$log"; fail "$name: exit status 0 after an injected $sig"; }
  local p="shardtrain: fatal \[rank $rank/2\]"
  grep -qE "^$p $sig \([a-z -]+\) in process [0-9]+ on [^,]+, thread [0-9]+ .*\(the main thread\)" "$log" ||
    { cat "$log"; fail "$name: no '$p $sig ... (the main thread)' line"; }
  grep -qE "^$p fault address 0x[0-9a-f]+ \(" "$log" || { cat "$log"; fail "$name: no fault address"; }
  grep -qE "^$p backtrace of the faulting thread" "$log" || { cat "$log"; fail "$name: no backtrace header"; }
  # A symbolized frame of the function that faulted: shardtrain(_ZN10shardtrain<len><name>...+0x..)[0x..]
  local mangled="_ZN10shardtrain${#fn}${fn}E"
  grep -qE "^$p   #[0-9]+ .*/shardtrain\\(${mangled}[A-Za-z0-9_]*\\+0x[0-9a-f]+\\)\\[0x[0-9a-f]+\\]$" "$log" ||
    { cat "$log"; fail "$name: no backtrace frame naming shardtrain::$fn"; }
  grep -qE "^$p end of backtrace; ending the process with $sig" "$log" || { cat "$log"; fail "$name: no end line"; }
  # Death by the signal itself, as mpirun reports it.
  grep -qE "rank $rank with PID [0-9]+ on node .* exited on signal $signum \(" "$log" ||
    { cat "$log"; fail "$name: mpirun does not report rank $rank exiting on signal $signum"; }
  # Ours, not Open MPI's handler; and only the rank of the hook faulted.
  ! grep -q "Process received signal" "$log" || { cat "$log"; fail "$name: Open MPI's handler ran (ours was replaced)"; }
  local other=$((1 - rank))
  ! grep -q "shardtrain: fatal \[rank $other/" "$log" || { cat "$log"; fail "$name: rank $other reported a fault too"; }
  local pat
  for pat in "$@"; do
    grep -qE -- "$pat" "$log" || { cat "$log"; fail "$name: output lacks '$pat'"; }
  done
  echo "ok: $name (exit $rc) -> $(grep -m1 "^$p $sig" "$log" | cut -c1-140)"
  echo "    $(grep -m1 -E "^$p   #[0-9]+ .*${mangled}" "$log")"
}

# After MPI_Init, rank 1: the rank is the real one (no "before MPI_Init" note).
fault segv_after_init SIGSEGV:1 1 11 SIGSEGV fatal_signal_test_segv \
  'fault address 0x0 \(SEGV_MAPERR'
! grep -q "before MPI_Init" "$WORK/segv_after_init.log" || fail "segv_after_init: says 'before MPI_Init' after it"
# Before MPI_Init, rank 0: the rank from mpirun's environment (OMPI_COMM_WORLD_RANK), the world size too.
fault segv_before_init SIGSEGV:0:pre 0 11 SIGSEGV fatal_signal_test_segv \
  'rank from OMPI_COMM_WORLD_RANK, before MPI_Init completed'
# A call through a null function pointer: instruction at 0x0, and the backtrace names the caller.
fault null_call NULLCALL:1 1 11 SIGSEGV fatal_signal_test_null_call \
  'instruction at 0x0$' 'a call through a null function pointer'
# A call through a dangling function pointer (into an unmapped page, as after a library was unloaded).
fault wild_call WILDCALL:0 0 11 SIGSEGV fatal_signal_test_wild_call \
  'the instruction address is in no mapping: a call through a dangling function pointer'
fault sigbus SIGBUS:1 1 7 SIGBUS fatal_signal_test_bus 'BUS_ADRERR'
fault sigfpe SIGFPE:0 0 8 SIGFPE fatal_signal_test_fpe 'FPE_INTDIV'
fault sigill SIGILL:1 1 4 SIGILL fatal_signal_test_ill 'ILL_ILLOP'
# Stack overflow on the main thread: the handler runs on the alternate stack.
fault stack_overflow STACKOVERFLOW:0 0 11 SIGSEGV fatal_signal_test_recurse 'SEGV_(MAPERR|ACCERR)'

# Every rank faults (no RANK): both report, each with its own rank.
log=$WORK/both.log
rc=0
SHARDTRAIN_TEST_FATAL_SIGNAL=SIGSEGV timeout -k 5 60 $MPIRUN -np 2 -x SHARDTRAIN_TEST_FATAL_SIGNAL "$BIN" --help >"$log" 2>&1 || rc=$?
{ [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; } || { cat "$log"; fail "both: exit status $rc"; }
# mpirun may end the second rank before it faults (it tears the job down at the first death): at
# least one report, and every report is whole (its frame of the faulting function present).
n=$(grep -cE '^shardtrain: fatal \[rank [01]/2\] SIGSEGV' "$log")
[ "$n" -ge 1 ] || { cat "$log"; fail "both: no report"; }
for r in 0 1; do
  if grep -q "^shardtrain: fatal \[rank $r/2\] SIGSEGV" "$log"; then
    grep -qE "^shardtrain: fatal \[rank $r/2\]   #[0-9]+ .*_ZN10shardtrain22fatal_signal_test_segvEv" "$log" ||
      { cat "$log"; fail "both: rank $r's report has no frame of the faulting function"; }
  fi
done
echo "ok: both ranks faulting: $n report(s), exit $rc"

# Malformed values are ignored: --help succeeds and nothing is reported.
for bad in SIGSEGV:x SIGKILL SIGSEGV:1:pre:2 sigsegv; do
  log=$WORK/bad.log
  SHARDTRAIN_TEST_FATAL_SIGNAL=$bad timeout -k 5 60 $MPIRUN -np 2 -x SHARDTRAIN_TEST_FATAL_SIGNAL "$BIN" --help >"$log" 2>&1 ||
    { cat "$log"; fail "malformed hook value '$bad': the job failed"; }
  ! grep -q "shardtrain: fatal" "$log" || { cat "$log"; fail "malformed hook value '$bad': a fault was injected"; }
done
echo "ok: malformed hook values (SIGSEGV:x, SIGKILL, SIGSEGV:1:pre:2, sigsegv) ignored"
