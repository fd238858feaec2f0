#!/usr/bin/env bash
# CPU start-up (issue 12, items 1 and 3): the first log line names the OpenBLAS kernel set, which is
# the best the CPU's features allow with no environment variable set (on VMs that mask the CPU
# model OpenBLAS alone picks Prescott); OPENBLAS_CORETYPE set by the user is respected, with a note;
# a kernel set failing the start-up GEMM check (forced by the test hook SHARDTRAIN_TEST_BLAS_FAIL)
# gives way to the next weaker one with a warning and training goes on; when every set fails every
# rank refuses. Threads: --threads beyond a rank's affinity mask warns, naming --bind-to none and
# --cpus-per-task; unbound ranks split the cores. Expectations come from this CPU's flags, so the
# test passes on machines without AVX-512 (or AVX) too.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
ARGS=(--model tiny --data "$DATA" --seq-len 16 --global-batch 4 --steps 2 --eval-every 0 --eval-batches 1 --device cpu)
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE SHARDTRAIN_TEST_BLAS_FAIL  # each case sets what it tests

# The kernel sets OpenBLAS may rightly use on this CPU (blas_select.h: kernel_level).
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ $flags == *" $1 "* ]]; }
if has avx512f && has avx512bw && has avx512vl && has avx512dq && has avx512cd && has avx2 && has fma; then
  level=AVX-512; good="SkylakeX|Cooperlake|SapphireRapids"
elif has avx2 && has fma; then
  level=AVX2; good="Haswell|Zen"
elif has avx; then
  level=AVX; good="Sandybridge|Bulldozer|Piledriver|Steamroller|Excavator"
else
  level=SSE; good="[A-Za-z0-9()_]+"
fi

run() {  # run NAME NP [MPIRUN OPTIONS...] -- [SHARDTRAIN OPTIONS...]: must succeed; log in $WORK/NAME.log
  local name=$1 np=$2 mpi=() extra=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do mpi+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  extra=("$@")
  timeout -k 5 120 $MPIRUN "${mpi[@]}" -np "$np" "$BIN" "${ARGS[@]}" "${extra[@]}" >"$WORK/$name.log" 2>&1 \
    || { cat "$WORK/$name.log"; fail "$name: run failed"; }
  grep -q '^done:' "$WORK/$name.log" || { cat "$WORK/$name.log"; fail "$name: training did not finish"; }
}
first() { grep -m1 '^shardtrain: ' "$WORK/$1.log"; }
kernels() { first "$1" | grep -oE 'with [^ ]+ kernels' | awk '{print $2}'; }

# 1. A plain mpirun: the fastest kernels the CPU allows, chosen without any variable.
run plain 2 --
line=$(first plain)
[[ $line == *"OpenBLAS "*" kernels ("* ]] || fail "plain: first line names no BLAS kernels: $line"
used=$(kernels plain)
[[ $used =~ ^($good)$ ]] || fail "plain: $level CPU runs '$used' kernels, expected one of $good: $line"
[[ $line == *"GEMM check passed"* ]] || fail "plain: no GEMM check outcome: $line"
echo "ok: plain mpirun on a CPU with $level uses $used: $(echo "$line" | grep -oE 'OpenBLAS .*check passed\)')"

# 2. The user's OPENBLAS_CORETYPE wins, with a note when the CPU could do better.
OPENBLAS_CORETYPE=Prescott run user 2 -x OPENBLAS_CORETYPE --
[ "$(kernels user)" = Prescott ] || fail "user: OPENBLAS_CORETYPE=Prescott not used: $(first user)"
first user | grep -qF "set by OPENBLAS_CORETYPE" || fail "user: the line does not say why: $(first user)"
if [ "$level" != SSE ]; then
  grep -q "^note: OPENBLAS_CORETYPE=Prescott selects OpenBLAS's Prescott kernels; this CPU has" "$WORK/user.log" \
    || { cat "$WORK/user.log"; fail "user: no note that faster kernels exist"; }
fi
echo "ok: OPENBLAS_CORETYPE=Prescott is respected: $(grep -m1 '^note: OPENBLAS' "$WORK/user.log" || first user)"

# 2a. What some sites export because older OpenBLAS builds misbehave on their processors:
#     OPENBLAS_CORETYPE=Haswell on a CPU with AVX-512. Honoured (the first line names Haswell), with
#     the note that this CPU runs a faster set. Runs where the CPU has AVX-512; elsewhere Haswell is
#     this CPU's own level or above it, and case 2 covers the note.
if [ "$level" = AVX-512 ]; then
  OPENBLAS_CORETYPE=Haswell OPENBLAS_L2_SIZE=512 run haswell 2 -x OPENBLAS_CORETYPE -x OPENBLAS_L2_SIZE --
  [ "$(kernels haswell)" = Haswell ] || fail "haswell: OPENBLAS_CORETYPE=Haswell not used: $(first haswell)"
  first haswell | grep -qF "set by OPENBLAS_CORETYPE" || fail "haswell: the line does not say why: $(first haswell)"
  grep -qE "^note: OPENBLAS_CORETYPE=Haswell selects OpenBLAS's Haswell kernels; this CPU has AVX-512[^;]* and runs ($good) \(faster\); unset OPENBLAS_CORETYPE to use them\$" \
    "$WORK/haswell.log" || { cat "$WORK/haswell.log"; fail "haswell: no note that this AVX-512 CPU runs faster kernels"; }
  echo "ok: OPENBLAS_CORETYPE=Haswell on an AVX-512 CPU: $(kernels haswell) kernels, $(grep -m1 '^note: OPENBLAS' "$WORK/haswell.log")"
else
  echo "skip: OPENBLAS_CORETYPE=Haswell note: this CPU has $level, not AVX-512"
fi

# 2b. A restart marker left in the environment by someone else (garbage, or copied from a running
#     rank) is ignored with a note: the choice is made as in a plain start.
SHARDTRAIN_BLAS_STARTUP=$'reexecs=9\nfailed=SkylakeX' run stale 1 -x SHARDTRAIN_BLAS_STARTUP --
[ "$(kernels stale)" = "$used" ] || fail "stale marker: '$(kernels stale)' kernels instead of $used: $(first stale)"
grep -q "^note: SHARDTRAIN_BLAS_STARTUP was in the environment but not set by this start" "$WORK/stale.log" \
  || { cat "$WORK/stale.log"; fail "stale marker: no note"; }
echo "ok: a stale SHARDTRAIN_BLAS_STARTUP is ignored with a note, $used kernels as in a plain start"

# 3. The set in use fails the GEMM check (test hook): the next weaker one runs, with a warning.
if [ "$used" != Prescott ]; then
  SHARDTRAIN_TEST_BLAS_FAIL=$used run fallback 2 -x SHARDTRAIN_TEST_BLAS_FAIL --
  next=$(kernels fallback)
  [ -n "$next" ] && [ "$next" != "$used" ] || fail "fallback: still '$next' kernels: $(first fallback)"
  grep -q "^warning: OpenBLAS's $used kernels failed the start-up GEMM check: sgemm .* x the bound .*; falling back to $next" \
    "$WORK/fallback.log" || { cat "$WORK/fallback.log"; fail "fallback: no warning naming $used and $next"; }
  first fallback | grep -qF "after $used failed the GEMM check" || fail "fallback: the line does not say why: $(first fallback)"
  echo "ok: $used failing the GEMM check falls back to $next, training goes on"
fi

# 4. Every set fails: every rank refuses, naming the sets tried.
export SHARDTRAIN_TEST_BLAS_FAIL=all
expect_fail all_fail "no other kernel set is left to try" 2 "${ARGS[@]}"
unset SHARDTRAIN_TEST_BLAS_FAIL

# 5. --threads beyond the rank's mask (mpirun binds to a core): a warning with the remedies.
run threads3 1 --bind-to core -- --threads 3
first threads3 | grep -qE "3 thread\(s\) per rank \(rank 0 bound to CPUs? [0-9,-]+\)" || fail "threads3: $(first threads3)"
grep -q "^warning: option '--threads 3' is more than the CPUs rank 0 may run on .*'--bind-to none'.*'--cpus-per-task=3'" \
  "$WORK/threads3.log" || { cat "$WORK/threads3.log"; fail "threads3: no warning"; }
echo "ok: --threads 3 on a rank bound to one core warns: $(grep -m1 -oE "^warning: option '--threads 3'[^.]*" "$WORK/threads3.log")"

# 6. Two unbound ranks (--bind-to none) split the cores they see: --threads 0 gives each half.
run unbound 2 --bind-to none --
cores=$(python3 -c 'import os
c = set()
for n in os.sched_getaffinity(0):
    try: c.add(tuple(open(f"/sys/devices/system/cpu/cpu{n}/topology/{f}").read() for f in ("physical_package_id", "core_id")))
    except OSError: c.add(("cpu", n))
print(len(c))')
want=$((cores / 2 > 0 ? cores / 2 : 1))
first unbound | grep -qF " $want thread(s) per rank (" || fail "unbound: expected $want threads per rank ($cores cores): $(first unbound)"
first unbound | grep -qF "shared by up to 2 ranks" || fail "unbound: the line does not say the ranks share CPUs: $(first unbound)"
! grep -q '^warning' "$WORK/unbound.log" || fail "unbound: unexpected warning: $(grep '^warning' "$WORK/unbound.log")"
echo "ok: 2 unbound ranks on $cores core(s): $want thread(s) each: $(first unbound | grep -oE '[0-9]+ thread\(s\) per rank \([^)]*\)')"

# 7. Started through the dynamic loader (tests/gpu/bundle.sh does so to bring its own glibc): the
#    restart must repeat the loader's command line, not just the program's arguments.
interp=$(readelf -l "$BIN" 2>/dev/null | grep -oE '/[^] ]*ld-linux[^] ]*' | head -1 || true)
if [ -n "$interp" ] && [ -x "$interp" ]; then
  timeout -k 5 120 $MPIRUN -np 1 "$interp" --library-path /nonexistent-dir "$BIN" "${ARGS[@]}" >"$WORK/loader.log" 2>&1 \
    || { cat "$WORK/loader.log"; fail "loader: run through $interp failed"; }
  [ "$(kernels loader)" = "$used" ] || fail "loader: '$(kernels loader)' kernels, expected $used: $(first loader)"
  echo "ok: started as '$interp $BIN ...': $used kernels"
fi

# 8. The process keeps its name through the kernel-set restart (it execs its own path, not
#    /proc/self/exe, which would name it "exe"), so ps -C shardtrain, pgrep and top find the ranks.
"$BIN" --model tiny --data "$DATA" --seq-len 16 --global-batch 4 --steps 100000 --eval-every 0 --device cpu \
  >"$WORK/name.log" 2>&1 &  # still training while we look
pid=$!
for _ in $(seq 1 300); do grep -q '^shardtrain: ' "$WORK/name.log" && break; sleep 0.1; done
name=$(cat "/proc/$pid/comm" 2>/dev/null || true)
kill "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
[ "$name" = shardtrain ] || { cat "$WORK/name.log"; fail "process name '$name' after start-up, expected shardtrain"; }
echo "ok: process name after start-up: $name (running $(first name | grep -oE 'with [^ ]+ kernels'))"
