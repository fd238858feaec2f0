#!/usr/bin/env bash
# Runs every shardtrain test group, each under a timeout so that a hang fails instead of stalling,
# and ends with one line "summary: N passed, M failed" (N, M count GoogleTest cases, end-to-end
# scripts and the scenarios of tests/slurm/run.sh), followed by ", K skipped" when a group skipped:
# a group whose script exits 77 (tests/slurm/run.sh where Slurm cannot start) counts as neither
# passed nor failed, and its "skipped: REASON" line is printed. Logs: build/test-logs/. Exit status
# non-zero iff something failed (a skip is not a failure).
#
# Groups run TEST_JOBS at a time (default 2): one group alone keeps two cores about a third busy
# (mpirun start-up, Python, waits), and every group has its own scratch directory (TMPDIR). A group
# whose checks bound a time (a signal answered within 2 s, a refusal within 10 s, a race against a
# disk filler) runs with nothing beside it: `ALONE=1 run ...`. Each line gives the group's wall time
# and the CPU time of its processes; lines come in the order the groups end.
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none  # containers often forbid CMA (ptrace)
BUILD=${BUILD:-build}
LOGS=$BUILD/test-logs
TEST_JOBS=${TEST_JOBS:-2}
[[ "$TEST_JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "tests/run_all.sh: TEST_JOBS='$TEST_JOBS' is not a positive integer" >&2; exit 2; }
mkdir -p "$LOGS"
# Short on purpose: Open MPI puts its session directory's sockets under TMPDIR (108-byte limit).
SCRATCH=$(mktemp -d /tmp/st-tests.XXXXXX)
# Interrupted (Ctrl-C, SIGTERM): end the running groups too. `timeout` puts each group in a process
# group of its own, out of reach of the terminal's SIGINT: it is sent SIGTERM, which it passes on to
# the group (tests/slurm/run.sh then stops its daemons), and its -k bounds the wait.
cleanup() {
  local p
  for p in $(jobs -p); do
    pkill -TERM -P "$p" 2>/dev/null
    kill "$p" 2>/dev/null
  done
  wait
  rm -rf "$SCRATCH"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
pass=0
fail=0
skip=0
groups=0
failed=()
skipped=()
running=()
declare -A pid_of started tmo_of gtest_of
T0=$SECONDS

# run NAME TIMEOUT_S CMD...: a GoogleTest binary (cases counted from its summary), tests/slurm/run.sh
# (scenarios counted from its "slurm-test: N passed, M failed") or a script (1 case). Exit status 77:
# skipped. KILL_AFTER (default 10): seconds between the timeout's SIGTERM and SIGKILL. Variables set
# before `run` (FOO=1 run ...) reach the group's processes. Starts the group once fewer than
# TEST_JOBS groups run; ALONE=1: once none runs, and waits for it to end.
run() {
  local name=$1 tmo=$2
  shift 2
  [ -z "${pid_of[$name]+x}" ] || { echo "tests/run_all.sh: group '$name' named twice" >&2; exit 2; }
  # Cases are counted from a GoogleTest summary only for the GoogleTest binaries: an end-to-end
  # script that prints a GoogleTest log on failure is still one case.
  local a
  gtest_of[$name]=
  for a in "$@"; do [[ "$a" == *_tests ]] && gtest_of[$name]=1; done
  if [ -n "${ALONE:-}" ]; then drain 0; else drain $((TEST_JOBS - 1)); fi
  local log=$LOGS/$name.log
  # The scratch directory is numbered, not named: a test that greps its own output for a word
  # (test_stragglers: "straggler") must not find it in its paths.
  local tmp=$SCRATCH/$((++groups))
  rm -f "$log.end"
  mkdir -p "$tmp"
  (
    export TMPDIR=$tmp TEST_TMPDIR=$tmp
    timeout -k "${KILL_AFTER:-10}" "$tmo" "$@" >"$log" 2>&1
    rc=$?
    # `times`' second line: the user and system CPU time of this subshell's children, the group
    # (written to a file: in a pipe or $(...) it would describe a child shell instead).
    times >"$log.times"
    cpu=$(awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); s += a[1] * 60 + a[2] } printf "%.0f", s }' "$log.times")
    rm -rf "$tmp" "$log.times"
    echo "$rc ${cpu:-0}" >"$log.end"
  ) &
  pid_of[$name]=$!
  started[$name]=$SECONDS
  tmo_of[$name]=$tmo
  running+=("$name")
  if [ -n "${ALONE:-}" ]; then drain 0; fi
}

# drain N: waits until at most N groups run, reporting each as it ends.
drain() {
  while [ ${#running[@]} -gt "$1" ]; do
    wait -n 2>/dev/null
    local still=() n
    for n in "${running[@]}"; do
      if [ ! -e "$LOGS/$n.log.end" ] && ! kill -0 "${pid_of[$n]}" 2>/dev/null && [ ! -e "$LOGS/$n.log.end" ]; then
        echo "255 0" >"$LOGS/$n.log.end"  # its subshell was killed before it could say how the group ended
      fi
      if [ -e "$LOGS/$n.log.end" ]; then
        wait "${pid_of[$n]}" 2>/dev/null
        report "$n"
      else
        still+=("$n")
      fi
    done
    running=("${still[@]}")
  done
}

# report NAME: counts and prints the result of a group that ended.
report() {
  local name=$1 log=$LOGS/$1.log rc cpu
  read -r rc cpu <"$log.end"
  rm -f "$log.end"
  local took="$(printf '%4ds %4ds cpu' $((SECONDS - started[$name])) "$cpu")"
  if [ "$rc" -eq 77 ]; then
    skip=$((skip + 1))
    skipped+=("$name")
    printf '  skip  %-34s %s  %s\n' "$name" "$took" "$(grep -m1 -o 'skipped: .*' "$log")"
    return
  fi
  local p= f=
  if [ -n "${gtest_of[$name]}" ]; then
    p=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$' | head -1)
    f=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$log" | grep -oE '[0-9]+' | head -1)
  fi
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
    printf '  ok    %-34s %s  %s\n' "$name" "$took" "${p:+$p cases}"
    # GoogleTest binaries that skip every case without a CUDA device say so once.
    grep -m1 -o 'skipped: no CUDA device.*' "$log" | sed 's/^/        /' || true
  else
    # 124: timeout's SIGTERM ended it; 137: its SIGKILL, KILL_AFTER seconds later.
    case $rc in 124 | 137) echo "  TIMEOUT after ${tmo_of[$name]}s: $name" ;; esac
    printf '  FAIL  %-34s %s  (rc %d, log %s)\n' "$name" "$took" "$rc" "$log"
    tail -n 30 "$log" | sed 's/^/        /'
    failed+=("$name")
  fi
}

# The header names the CPU and the BLAS-related environment the suite ran with (a failure report then
# shows it: OpenBLAS's kernel choice, and shardtrain's notes about it, depend on both).
blas_env=$(for v in OPENBLAS_CORETYPE OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS OPENBLAS_VERBOSE GOTO_NUM_THREADS \
  OMP_NUM_THREADS OMP_PROC_BIND OMP_PLACES; do [ -n "${!v+x}" ] && printf ' %s=%s' "$v" "${!v}"; done)
cpu=$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
echo "shardtrain tests ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) cores, ${cpu:-unknown CPU}; BLAS environment:${blas_env:- none set}; $TEST_JOBS groups at a time)"
# The groups whose checks bound a time, first and one at a time.
for t in input_files json_limits checkpoint_diskfull fatal_signal stragglers preemption p2p; do
  ALONE=1 run "test_$t"       600 bash "tests/e2e/test_$t.sh" "$BUILD"
done
# The job scripts under a private Slurm cluster (~2-3.5 min; skipped where Slurm cannot start)
# next: its daemons must be up within 30 s, so it starts beside the light groups below, not beside
# the 4-rank group. Its EXIT trap stops the daemons it started: it gets time to do so after a timeout.
BUILD=$BUILD KILL_AFTER=60 run slurm 420 bash tests/slurm/run.sh
# Static checks of the source tree (no build needed; issue 54): the layer order of the includes
# (tests/check_layers.py); docs/architecture.md names every file of src/ and include/shardtrain/
# (tests/check_architecture_doc.py); every relative link and #anchor of README.md,
# CHANGELOG.md and docs/, and every repository path README.md and the topic pages name
# (tests/docs/check_links.py).
run layers                     60 python3 tests/check_layers.py
run docs-links                 60 python3 tests/docs/check_links.py
run architecture-doc           60 python3 tests/check_architecture_doc.py
run unit                      300 mpirun -np 1 "$BUILD/unit_tests" --gtest_color=no
for n in 1 2; do
  run "mpi-np$n"              420 mpirun -np "$n" "$BUILD/mpi_tests" --gtest_color=no
done
# GPU tests: the CUDA backend against the CPU backend; each skips without a CUDA device.
run gpu                       300 mpirun -np 1 "$BUILD/gpu_tests" --gtest_color=no
# The same tests with the CUDA backends replaced by a float64 emulation (tests/gpu/emulated_backend.h):
# checks the GPU tests themselves, and the CPU backend against float64, where no GPU is present.
SHARDTRAIN_GPU_TESTS_EMULATE=1 run gpu-emulated 300 mpirun -np 1 -x SHARDTRAIN_GPU_TESTS_EMULATE "$BUILD/gpu_tests" --gtest_color=no
# The longest groups (3-5 min each beside another) before the many short ones, so that none is
# left running alone at the end.
run mpi-np4                   600 mpirun -np 4 "$BUILD/mpi_tests" --gtest_color=no
run test_fuzz                 600 bash tests/e2e/test_fuzz.sh "$BUILD"
run test_gpu_check_script     600 bash tests/e2e/test_gpu_check_script.sh "$BUILD"
run mpi-np3                   600 mpirun -np 3 "$BUILD/mpi_tests" --gtest_color=no
for t in tests/e2e/test_*.sh; do
  n=$(basename "$t" .sh)
  case " test_cp_matrix test_pp_matrix " in *" $n "*) continue ;; esac  # make test-cp-matrix, make test-pp-matrix
  [ -z "${pid_of[$n]+x}" ] || continue                                  # run above
  run "$n"                    600 bash "$t" "$BUILD"
done
drain 0

echo
[ ${#failed[@]} -gt 0 ] && echo "failed: ${failed[*]}"
[ ${#skipped[@]} -gt 0 ] && echo "skipped: ${skipped[*]}"
echo "time: $((SECONDS - T0)) s, $TEST_JOBS groups at a time"
echo "summary: $pass passed, $fail failed${skipped[*]:+, $skip skipped}"
[ "$fail" -eq 0 ] && [ ${#failed[@]} -eq 0 ]
