#!/usr/bin/env bash
# Runs every shardtrain test group, each under a timeout so that a hang fails instead of stalling,
# and ends with one line "summary: N passed, M failed" (N, M count GoogleTest cases, end-to-end
# scripts and the scenarios of tests/slurm/run.sh), followed by ", K skipped" when a group skipped:
# a group whose script exits 77 (tests/slurm/run.sh where Slurm cannot start) counts as neither
# passed nor failed, and its "skipped: REASON" line is printed. Logs: build/test-logs/. Exit status
# non-zero iff something failed (a skip is not a failure).
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none  # containers often forbid CMA (ptrace)
BUILD=${BUILD:-build}
LOGS=$BUILD/test-logs
mkdir -p "$LOGS"
pass=0
fail=0
skip=0
failed=()
skipped=()

# run NAME TIMEOUT_S CMD...: a GoogleTest binary (cases counted from its summary), tests/slurm/run.sh
# (scenarios counted from its "slurm-test: N passed, M failed") or a script (1 case). Exit status 77:
# skipped. KILL_AFTER (default 10): seconds between the timeout's SIGTERM and SIGKILL.
run() {
  local name=$1 tmo=$2
  shift 2
  local log=$LOGS/$name.log t0=$SECONDS
  timeout -k "${KILL_AFTER:-10}" "$tmo" "$@" >"$log" 2>&1
  local rc=$?
  if [ "$rc" -eq 77 ]; then
    skip=$((skip + 1))
    skipped+=("$name")
    printf '  skip  %-34s %4ds  %s\n' "$name" $((SECONDS - t0)) "$(grep -m1 -o 'skipped: .*' "$log")"
    return
  fi
  local p f
  p=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$' | head -1)
  f=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$log" | grep -oE '[0-9]+' | head -1)
  if [ -z "$p$f" ] && grep -qE '^slurm-test: [0-9]+ passed, [0-9]+ failed$' "$log"; then
    p=$(grep -E '^slurm-test: [0-9]+ passed' "$log" | tail -1 | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+')
    f=$(grep -E '^slurm-test: [0-9]+ passed' "$log" | tail -1 | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+')
    [ "$f" != 0 ] || f=
  fi
  if [ -n "$p$f" ]; then
    pass=$((pass + ${p:-0}))
    fail=$((fail + ${f:-0}))
    if [ "$rc" -ne 0 ] && [ -z "$f" ]; then fail=$((fail + 1)); fi
  elif [ "$rc" -eq 0 ]; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
  fi
  if [ "$rc" -eq 0 ]; then
    printf '  ok    %-34s %4ds  %s\n' "$name" $((SECONDS - t0)) "${p:+$p cases}"
  else
    [ "$rc" -eq 124 ] && echo "  TIMEOUT after ${tmo}s: $name"
    printf '  FAIL  %-34s %4ds  (rc %d, log %s)\n' "$name" $((SECONDS - t0)) "$rc" "$log"
    tail -n 30 "$log" | sed 's/^/        /'
    failed+=("$name")
  fi
}

# The header names the CPU and the BLAS-related environment the suite ran with (a failure report then
# shows it: OpenBLAS's kernel choice, and shardtrain's notes about it, depend on both).
blas_env=$(for v in OPENBLAS_CORETYPE OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS OPENBLAS_VERBOSE GOTO_NUM_THREADS \
  OMP_NUM_THREADS OMP_PROC_BIND OMP_PLACES; do [ -n "${!v+x}" ] && printf ' %s=%s' "$v" "${!v}"; done)
cpu=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
echo "shardtrain tests ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) cores, ${cpu:-unknown CPU}; BLAS environment:${blas_env:- none set})"
# Static checks of the source tree (no build needed; issue 54): the layer order of the includes
# (tests/check_layers.py); docs/architecture.md names every file of src/ and include/shardtrain/
# (tests/check_architecture_doc.py); every relative link and #anchor of README.md,
# CHANGELOG.md and docs/, and every repository path README.md and the topic pages name
# (tests/docs/check_links.py).
run layers                     60 python3 tests/check_layers.py
run docs-links                 60 python3 tests/docs/check_links.py
run architecture-doc           60 python3 tests/check_architecture_doc.py
run unit                      300 mpirun -np 1 "$BUILD/unit_tests" --gtest_color=no
for n in 1 2 3 4; do
  run "mpi-np$n"              420 mpirun -np "$n" "$BUILD/mpi_tests" --gtest_color=no
done
# GPU tests: the CUDA backend against the CPU backend; each skips without a CUDA device.
run gpu                       300 mpirun -np 1 "$BUILD/gpu_tests" --gtest_color=no
grep -m1 -o 'skipped: no CUDA device.*' "$LOGS/gpu.log" | sed 's/^/        /' || true
# The same tests with the CUDA backends replaced by a float64 emulation (tests/gpu/emulated_backend.h):
# checks the GPU tests themselves, and the CPU backend against float64, where no GPU is present.
SHARDTRAIN_GPU_TESTS_EMULATE=1 run gpu-emulated 300 mpirun -np 1 -x SHARDTRAIN_GPU_TESTS_EMULATE "$BUILD/gpu_tests" --gtest_color=no
for t in tests/e2e/test_*.sh; do
  [ "$t" = tests/e2e/test_cp_matrix.sh ] && continue  # the longer CP matrix: make test-cp-matrix
  [ "$t" = tests/e2e/test_pp_matrix.sh ] && continue  # the whole PP matrix: make test-pp-matrix
  run "$(basename "$t" .sh)"  600 bash "$t" "$BUILD"
done
# The job scripts under a private Slurm cluster (~2 min; skipped where Slurm cannot start). Its
# EXIT trap stops the daemons it started: give it time to do so after a timeout.
BUILD=$BUILD KILL_AFTER=60 run slurm 420 bash tests/slurm/run.sh

echo
[ ${#failed[@]} -gt 0 ] && echo "failed: ${failed[*]}"
[ ${#skipped[@]} -gt 0 ] && echo "skipped: ${skipped[*]}"
echo "summary: $pass passed, $fail failed${skipped[*]:+, $skip skipped}"
[ "$fail" -eq 0 ] && [ ${#failed[@]} -eq 0 ]
