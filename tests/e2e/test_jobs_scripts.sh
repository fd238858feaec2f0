#!/usr/bin/env bash
source "$(dirname "$0")/common.sh"
# The Slurm job scripts in jobs/, run under plain bash with the variables Slurm sets in a job.
#  * shellcheck (every finding fails, style included) on jobs/*.sbatch, jobs/job-common.sh,
#    jobs/sigterm-blocked (which must block SIGTERM, and only it, in its command), this script,
#    tests/jobs/run.sh and tests/slurm/*.sh; every #SBATCH line has a comment line above it; the training scripts
#    request --signal=USR1@120 and --requeue, export.sbatch --ntasks=1, train-gpu.sbatch one GPU a task.
#  * tests/slurm/run.sh without Slurm on PATH: skipped (77); with SLURM_TEST_REQUIRE=1 a failure (1).
#  * SHARDTRAIN_DRYRUN=1: the printed launch command, one line: launcher (srun --mpi=pmix, or mpirun
#    with LAUNCHER=mpirun), rank count from SLURM_NTASKS (or nodes x tasks per node), --config,
#    --checkpoint-dir (job file's, command line's, per array task), --resume auto, --threads from
#    SLURM_CPUS_PER_TASK, pass-through options, array sweeps (--seed = SLURM_ARRAY_TASK_ID, or a job
#    file per index), --device cuda only for a binary that has it, the export of the checkpoint named
#    by 'latest'; usage errors exit 2; an already finished run exits 0 without launching.
#  * For real, with stand-ins for srun, scontrol and shardtrain on PATH: status 0 -> exit 0; status 75
#    (preempted) -> `scontrol requeue $SLURM_JOB_ID`, exit 0; other statuses are returned, never
#    requeued; SIGTERM to the batch shell and the ranks (as Slurm sends) and SIGUSR1 to the batch
#    shell (--signal=B:USR1) end in a checkpoint exit 75 and a requeue; array tasks requeue themselves.
JOBS=$ROOT/jobs
SCRIPTS=(train-cpu.sbatch train-multinode.sbatch train-gpu.sbatch export.sbatch)
TRAIN=(train-cpu.sbatch train-multinode.sbatch train-gpu.sbatch)

# A clean environment: no Slurm job, launcher or script settings leak in from the caller.
while read -r v; do
  case $v in
    SLURM_* | SLURMD_* | SHARDTRAIN_* | LAUNCHER | JOB_FILE | SRUN_* | MPIRUN_ARGS | CKPT_DIR | CHECKPOINT | EXPORT_DIR) unset "$v" ;;
  esac
done < <(compgen -e)

# ---- 1. Static checks ----
command -v shellcheck >/dev/null || fail "shellcheck is not installed (make deps installs it)"
LINT=("$JOBS"/*.sbatch "$JOBS"/job-common.sh "$JOBS"/sigterm-blocked "$ROOT/tests/e2e/test_jobs_scripts.sh" "$ROOT/tests/jobs/run.sh"
  "$ROOT/tests/slurm/run.sh" "$ROOT/tests/slurm/cluster.sh")
shellcheck -x -P SCRIPTDIR "${LINT[@]}" >"$WORK/shellcheck.log" 2>&1 || { cat "$WORK/shellcheck.log"; fail "shellcheck reports findings"; }
echo "ok: shellcheck finds nothing (any severity) in ${#LINT[@]} scripts: ${LINT[*]#"$ROOT"/}"

# jobs/sigterm-blocked (mpirun's and orted's wrapper, job-common.sh "SIGTERM and Open MPI's mpirun"):
# the command runs with SIGTERM (signal 15, bit 14) blocked, as the kernel reports it, and nothing
# else; its arguments and exit status pass through.
# (grep itself reads the mask: dash unblocks signals in the children it forks.)
blk=$("$JOBS/sigterm-blocked" grep "^SigBlk:" /proc/self/status) || fail "sigterm-blocked grep failed"
blk=${blk##*[[:space:]]}
[ "$((0x$blk))" -eq $((1 << 14)) ] || fail "sigterm-blocked: SigBlk $blk, expected only SIGTERM (0000000000004000)"
rc=0
"$JOBS/sigterm-blocked" sh -c 'exit 7' || rc=$?
[ "$rc" -eq 7 ] || fail "sigterm-blocked returned $rc for the command's status 7"
echo "ok: jobs/sigterm-blocked runs its command with SIGTERM blocked (SigBlk $blk), status passed through"

for s in "${SCRIPTS[@]}"; do
  f=$JOBS/$s
  [ "$(head -1 "$f")" = "#!/bin/bash" ] || fail "$s: first line is not #!/bin/bash"
  bash -n "$f" || fail "$s: bash -n"
  n=$(grep -c '^#SBATCH' "$f")
  [ "$n" -ge 4 ] || fail "$s: only $n #SBATCH lines"
  # Every #SBATCH line has a comment line (not itself an #SBATCH line) right above it.
  awk '/^#SBATCH/ && (prev !~ /^# / || prev ~ /^#SBATCH/) { print FILENAME ":" NR ": " $0; bad = 1 } { prev = $0 } END { exit bad }' "$f" ||
    fail "$s: #SBATCH lines without a comment line above them"
  # sbatch stops reading directives at the first command: every #SBATCH line comes before it.
  first_cmd=$(grep -n -v -E '^(#|$)' "$f" | head -1 | cut -d: -f1)
  last_sbatch=$(grep -n '^#SBATCH' "$f" | tail -1 | cut -d: -f1)
  [ "$last_sbatch" -lt "$first_cmd" ] || fail "$s: an #SBATCH line after the first command (line $first_cmd)"
done
for s in "${TRAIN[@]}"; do
  for d in '--signal=USR1@120' '--requeue' '--open-mode=append'; do
    grep -qx -- "#SBATCH $d" "$JOBS/$s" || fail "$s: no '#SBATCH $d'"
  done
done
grep -qx -- '#SBATCH --ntasks=1' "$JOBS/export.sbatch" || fail "export.sbatch: no '#SBATCH --ntasks=1'"
grep -qx -- '#SBATCH --gpus-per-task=1' "$JOBS/train-gpu.sbatch" || fail "train-gpu.sbatch: no '#SBATCH --gpus-per-task=1'"
grep -qE -- '^#SBATCH --ntasks-per-node=[0-9]+$' "$JOBS/train-gpu.sbatch" || fail "train-gpu.sbatch: no --ntasks-per-node"
grep -qE -- '^#SBATCH --nodes=[2-9]' "$JOBS/train-multinode.sbatch" || fail "train-multinode.sbatch: not multi-node"
echo "ok: ${#SCRIPTS[@]} sbatch scripts: #!/bin/bash, bash -n, each #SBATCH line commented and before the first command;" \
  "training scripts have --signal=USR1@120 --requeue --open-mode=append; export --ntasks=1; gpu --gpus-per-task=1"

# ---- 2. Dry runs ----
# The submit directory: a scratch copy of the repository's layout (jobs/ and build/ linked), so that
# relative paths (jobs/..., checkpoints/...) resolve as from the repository root, while checkpoints a
# user has under the real repository cannot change what the scripts print.
DRY=$WORK/submit-dry
mkdir -p "$DRY"
ln -s "$JOBS" "$DRY/jobs"
ln -s "$(dirname "$BIN")" "$DRY/build"
# What Slurm sets in a job of one node and 4 tasks of 8 cores (sbatch jobs/train-cpu.sbatch).
CPU_ENV=(SLURM_JOB_ID=4242 SLURM_JOBID=4242 SLURM_JOB_NAME=shardtrain-cpu SLURM_NTASKS=4 SLURM_NPROCS=4
  SLURM_JOB_NUM_NODES=1 SLURM_NNODES=1 SLURM_NTASKS_PER_NODE=4 SLURM_TASKS_PER_NODE=4 SLURM_CPUS_PER_TASK=8
  SLURM_CPUS_ON_NODE=32 SLURM_JOB_NODELIST=node01 SLURM_NODELIST=node01 SLURMD_NODENAME=node01
  SLURM_SUBMIT_DIR="$DRY" SLURM_SUBMIT_HOST=login01 SLURM_JOB_PARTITION=cpu SLURM_CLUSTER_NAME=test)
# 2 nodes x 4 tasks (train-multinode.sbatch, train-gpu.sbatch --nodes=2).
MULTI_ENV=(SLURM_JOB_ID=5151 SLURM_JOBID=5151 SLURM_JOB_NAME=shardtrain-multinode SLURM_NTASKS=8 SLURM_NPROCS=8
  SLURM_JOB_NUM_NODES=2 SLURM_NNODES=2 SLURM_NTASKS_PER_NODE=4 SLURM_TASKS_PER_NODE='4(x2)' SLURM_CPUS_PER_TASK=8
  SLURM_JOB_NODELIST='node[01-02]' SLURM_NODELIST='node[01-02]' SLURMD_NODENAME=node01 SLURM_SUBMIT_DIR="$DRY")
GPU_ENV=("${MULTI_ENV[@]}" SLURM_JOB_NAME=shardtrain-gpu SLURM_GPUS_PER_TASK=1 SLURM_GPUS_ON_NODE=4)
# Array task 3 of job 6000 (sbatch --array=1-4): its own job id 6003.
ARRAY_ENV=("${CPU_ENV[@]}" SLURM_JOB_ID=6003 SLURM_JOBID=6003 SLURM_ARRAY_JOB_ID=6000 SLURM_ARRAY_TASK_ID=3
  SLURM_ARRAY_TASK_MIN=1 SLURM_ARRAY_TASK_MAX=4 SLURM_ARRAY_TASK_COUNT=4 SLURM_ARRAY_TASK_STEP=1)
# One task of 4 cores (export.sbatch).
ONE_ENV=(SLURM_JOB_ID=7070 SLURM_JOBID=7070 SLURM_JOB_NAME=shardtrain-export SLURM_NTASKS=1 SLURM_NPROCS=1
  SLURM_JOB_NUM_NODES=1 SLURM_NNODES=1 SLURM_CPUS_PER_TASK=4 SLURM_JOB_NODELIST=node01 SLURM_SUBMIT_DIR="$DRY")

# dry NAME ENV... -- SCRIPT ARGS...: runs jobs/SCRIPT as `bash` from $DRY (the submit directory) with
# ENV and SHARDTRAIN_DRYRUN=1. Sets RC, OUT (stdout), ERR (stderr) and W (OUT's words); CASE=NAME.
dry() {
  CASE=$1
  shift
  local envs=()
  while [ "$1" != -- ]; do
    envs+=("$1")
    shift
  done
  shift
  local script=$JOBS/$1
  shift
  RC=0
  (cd "$DRY" && env "${envs[@]}" SHARDTRAIN_DRYRUN=1 bash "$script" "$@") >"$WORK/$CASE.out" 2>"$WORK/$CASE.err" || RC=$?
  OUT=$(cat "$WORK/$CASE.out")
  W=()
  read -r -a W <<<"$OUT"
}
show() { echo "--- $CASE: status $RC; stdout:"; cat "$WORK/$CASE.out"; echo "--- stderr:"; cat "$WORK/$CASE.err"; }
bad() {
  show >&2
  fail "$CASE: $*"
}
# launched LAUNCHER: exit 0 and exactly one line on stdout, which starts with LAUNCHER.
launched() {
  [ "$RC" -eq 0 ] || bad "exit status $RC"
  [ "$(wc -l <"$WORK/$CASE.out")" -eq 1 ] || bad "expected exactly one line on stdout"
  [ "${W[0]:-}" = "$1" ] || bad "command starts with '${W[0]:-}', expected '$1'"
}
# count WORD: occurrences of WORD among the command's words.
count() {
  local w n=0
  for w in "${W[@]}"; do [ "$w" != "$1" ] || n=$((n + 1)); done
  echo "$n"
}
# opt NAME VALUE: NAME occurs once and is followed by VALUE.
opt() {
  local i
  [ "$(count "$1")" -eq 1 ] || bad "'$1' occurs $(count "$1") times, expected once"
  for ((i = 0; i < ${#W[@]}; i++)); do
    if [ "${W[i]}" = "$1" ]; then
      [ "${W[i + 1]:-}" = "$2" ] || bad "'$1 ${W[i + 1]:-}', expected '$1 $2'"
    fi
  done
}
has() { [ "$(count "$1")" -eq 1 ] || bad "'$1' occurs $(count "$1") times, expected once"; }
hasnt() { [ "$(count "$1")" -eq 0 ] || bad "unexpected '$1'"; }
# errs STATUS TEXT: the script failed with STATUS, printed nothing on stdout and TEXT on stderr.
errs() {
  [ "$RC" -eq "$1" ] || bad "exit status $RC, expected $1"
  [ -z "$OUT" ] || bad "printed a command despite the error"
  grep -qF -- "$2" "$WORK/$CASE.err" || bad "stderr lacks '$2'"
}

# Stand-ins for ompi_info, first on PATH, so that what the scripts print does not depend on this
# machine's Open MPI: one with the UCX PML (the default for every dry run below), one without.
for k in ucx noucx; do
  mkdir -p "$WORK/ompi-$k"
  {
    echo '#!/bin/bash'
    echo 'echo "mca:pml:ob1:version:\"component:4.1.4\""'
    [ "$k" = noucx ] || echo 'echo "mca:pml:ucx:version:\"component:4.1.4\""'
  } >"$WORK/ompi-$k/ompi_info"
  chmod +x "$WORK/ompi-$k/ompi_info"
done
REAL_PATH=$PATH
export PATH="$WORK/ompi-ucx:$PATH"
UCX_EXPORT=--export=ALL,OMPI_MCA_pml=ucx,OMPI_MCA_pml_ucx_tls=any,OMPI_MCA_pml_ucx_devices=any
# As the scripts print it (printf %q, which escapes the commas; the line stays runnable as printed).
UCX_EXPORT_Q=$(printf '%q' "$UCX_EXPORT")

# train-cpu.sbatch: the whole line, exactly.
dry cpu "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch jobs/small-test.ini --steps 30 --lr 1e-3
want="srun --mpi=pmix --nodes=1 --ntasks=4 --ntasks-per-node=4 --cpus-per-task=8 --cpu-bind=cores $UCX_EXPORT_Q $BIN"
want+=" --config jobs/small-test.ini --checkpoint-dir checkpoints/small-test --resume auto --threads 8 --steps 30 --lr 1e-3"
launched srun
[ "$OUT" = "$want" ] || bad "command differs from: $want"
echo "ok: train-cpu dry run: $OUT"

# The start-up crash avoidance (docs/slurm-startup-crash.md): srun gets Open MPI's UCX PML where this
# Open MPI has one, unless the user chose (OMPI_MCA_pml, SHARDTRAIN_SRUN_PML=default); their own
# pml_ucx settings are kept; mpirun is left alone.
dry pml_default "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" SHARDTRAIN_SRUN_PML=default -- train-cpu.sbatch
launched srun
[[ $OUT != *--export* ]] || bad "SHARDTRAIN_SRUN_PML=default still exports a PML"
dry pml_user "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" OMPI_MCA_pml=ob1 SHARDTRAIN_SRUN_PML=ucx -- train-cpu.sbatch
launched srun
[[ $OUT != *--export* ]] || bad "OMPI_MCA_pml=ob1 set by the user, yet the command exports a PML"
grep -qF "SHARDTRAIN_SRUN_PML=ucx ignored: OMPI_MCA_pml=ob1 is set" "$WORK/$CASE.err" || bad "no note that the user's PML wins"
dry pml_user_tls "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" OMPI_MCA_pml_ucx_tls=rc_mlx5,sm -- train-cpu.sbatch
launched srun
has "$(printf '%q' --export=ALL,OMPI_MCA_pml=ucx,OMPI_MCA_pml_ucx_devices=any)"
dry pml_noucx "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" PATH="$WORK/ompi-noucx:$REAL_PATH" -- train-cpu.sbatch
launched srun
[[ $OUT != *--export* ]] || bad "an Open MPI without the UCX PML, yet the command exports it"
grep -qF "warning: this Open MPI ($WORK/ompi-noucx/ompi_info) has no UCX PML" "$WORK/$CASE.err" || bad "no warning about the missing UCX PML"
dry pml_noucx_required "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" PATH="$WORK/ompi-noucx:$REAL_PATH" SHARDTRAIN_SRUN_PML=ucx -- train-cpu.sbatch
errs 2 "SHARDTRAIN_SRUN_PML=ucx: this Open MPI ($WORK/ompi-noucx/ompi_info) has no UCX PML"
dry pml_bad "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" SHARDTRAIN_SRUN_PML=yes -- train-cpu.sbatch
errs 2 "SHARDTRAIN_SRUN_PML='yes': expected auto, ucx or default"
dry pml_bad_mpirun "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" SHARDTRAIN_SRUN_PML=UCX LAUNCHER=mpirun -- train-cpu.sbatch
errs 2 "SHARDTRAIN_SRUN_PML='UCX': expected auto, ucx or default"
dry pml_bad_one "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" SHARDTRAIN_SRUN_PML=on SLURM_NTASKS=1 -- train-cpu.sbatch
errs 2 "SHARDTRAIN_SRUN_PML='on': expected auto, ucx or default"
# srun's --export given by the user (SRUN_ARGS, or SLURM_EXPORT_ENV as sbatch --export=NONE leaves
# it): not replaced, and no second --export; a note says the avoidance is off.
dry pml_srun_args "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" SRUN_ARGS="--export=ALL,FOO=1" -- train-cpu.sbatch
launched srun
[ "$(grep -o -- --export <<<"$OUT" | wc -l)" -eq 1 ] || bad "expected only the user's --export"
has "$(printf "%q" --export=ALL,FOO=1)"
grep -qF "note: srun's --export is given" "$WORK/$CASE.err" || bad "no note that the user's --export leaves the PML alone"
dry pml_export_env "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" SLURM_EXPORT_ENV=NONE -- train-cpu.sbatch
launched srun
[[ $OUT != *--export* ]] || bad "SLURM_EXPORT_ENV set, yet the command has --export"
grep -qF "note: srun's --export is given" "$WORK/$CASE.err" || bad "no note for SLURM_EXPORT_ENV"
dry pml_export_env_required "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" SLURM_EXPORT_ENV=NONE SHARDTRAIN_SRUN_PML=ucx -- train-cpu.sbatch
errs 2 "SHARDTRAIN_SRUN_PML=ucx: srun's --export is given"
# ompi_info failing (status 3, though it printed the UCX line), and missing from PATH.
mkdir -p "$WORK/ompi-fail" "$WORK/no-ompi"
printf '#!/bin/bash\necho "mca:pml:ucx:version:x"\nexit 3\n' >"$WORK/ompi-fail/ompi_info"
chmod +x "$WORK/ompi-fail/ompi_info"
dry pml_info_fails "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" PATH="$WORK/ompi-fail:$REAL_PATH" -- train-cpu.sbatch
launched srun
[[ $OUT != *--export* ]] || bad "ompi_info failed, yet the command exports the PML"
grep -qF "warning: 'ompi_info --parsable' failed (status 3" "$WORK/$CASE.err" || bad "no warning that ompi_info failed"
for d in /usr/local/bin /usr/bin /bin; do
  for f in "$d"/*; do
    n=${f##*/}
    [ "$n" = ompi_info ] || [ -e "$WORK/no-ompi/$n" ] || ln -s "$f" "$WORK/no-ompi/$n"
  done
done
dry pml_no_info "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" PATH="$WORK/no-ompi" -- train-cpu.sbatch
launched srun
[[ $OUT != *--export* ]] || bad "no ompi_info, yet the command exports the PML"
[ ! -s "$WORK/$CASE.err" ] || ! grep -q "PML" "$WORK/$CASE.err" || bad "a note about the PML without Open MPI"
dry pml_no_info_required "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" PATH="$WORK/no-ompi" SHARDTRAIN_SRUN_PML=ucx -- train-cpu.sbatch
errs 2 "SHARDTRAIN_SRUN_PML=ucx: no ompi_info on PATH"
echo "ok: srun gets $UCX_EXPORT where Open MPI has the UCX PML; not with SHARDTRAIN_SRUN_PML=default or a user's OMPI_MCA_pml;" \
  "a user's pml_ucx_tls kept; a user's srun --export (SRUN_ARGS, SLURM_EXPORT_ENV) kept, with a note;" \
  "without the UCX PML, with a failing or no ompi_info: none (a warning; an error when required); a bad value refused with any launcher; not for one rank"

# Job file from JOB_FILE, and the default one; the default binary is the repository's build/shardtrain.
dry cpu_env "${CPU_ENV[@]}" JOB_FILE=jobs/llama-125m.ini -- train-cpu.sbatch
launched srun
opt --config jobs/llama-125m.ini
opt --checkpoint-dir checkpoints/llama-125m
[ "${W[8]}" = "$ROOT/build/shardtrain" ] || bad "binary '${W[8]}', expected the default $ROOT/build/shardtrain"
dry cpu_default "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch --steps 5
launched srun
opt --config "$ROOT/jobs/small-test.ini"
opt --steps 5
dry cpu_arg_wins "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" JOB_FILE=jobs/llama-350m.ini -- train-cpu.sbatch jobs/llama-125m.ini
opt --config jobs/llama-125m.ini
echo "ok: job file from \$1, else JOB_FILE, else jobs/small-test.ini; SHARDTRAIN_BIN defaults to $ROOT/build/shardtrain"

# Pass-through options that the script also sets: given once, the command line's value wins.
dry cpu_override "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch jobs/small-test.ini \
  --checkpoint-dir=/scratch/me/ck --threads 2 --resume /scratch/me/ck/step_00000020.h5
launched srun
opt --checkpoint-dir /scratch/me/ck
opt --threads 2
opt --resume /scratch/me/ck/step_00000020.h5
hasnt auto
hasnt --checkpoint-dir=/scratch/me/ck
echo "ok: --checkpoint-dir=DIR, --threads, --resume FILE on the command line replace the script's (each once)"

# Slurm's copy of the script (/var/spool/slurmd/jobN/slurm_script) finds the repository via SLURM_SUBMIT_DIR.
mkdir -p "$WORK/spool/job4242"
cp "$JOBS/train-cpu.sbatch" "$WORK/spool/job4242/slurm_script"
RC=0
(cd "$DRY" && env "${CPU_ENV[@]}" SHARDTRAIN_DRYRUN=1 bash "$WORK/spool/job4242/slurm_script" jobs/small-test.ini) \
  >"$WORK/spool.out" 2>"$WORK/spool.err" || RC=$?
if [ "$RC" -ne 0 ] || [ "$(cut -d' ' -f9 "$WORK/spool.out")" != "$DRY/build/shardtrain" ]; then
  cat "$WORK/spool.out" "$WORK/spool.err"
  fail "slurmd's copy of the script did not find the repository through SLURM_SUBMIT_DIR"
fi
echo "ok: slurmd's copy of the script (outside the repository) finds jobs/job-common.sh and build/shardtrain via SLURM_SUBMIT_DIR"

# train-multinode.sbatch: 2 nodes x 4 ranks; with srun, and with mpirun inside the allocation.
dry multi "${MULTI_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-multinode.sbatch jobs/llama-350m.ini
launched srun
for w in --mpi=pmix --nodes=2 --ntasks=8 --ntasks-per-node=4 --cpus-per-task=8 "$BIN"; do has "$w"; done
opt --config jobs/llama-350m.ini
opt --checkpoint-dir checkpoints/llama-350m
opt --resume auto
echo "ok: train-multinode dry run (srun): $OUT"
dry multi_no_ntasks "${MULTI_ENV[@]}" SLURM_NTASKS= SLURM_NPROCS= SHARDTRAIN_BIN="$BIN" SRUN_MPI=pmi2 -- train-multinode.sbatch jobs/llama-350m.ini
launched srun
has --ntasks=8
has --mpi=pmi2
dry multi_mpirun "${MULTI_ENV[@]}" SHARDTRAIN_BIN="$BIN" LAUNCHER=mpirun MPIRUN_ARGS="--report-bindings -x NCCL_DEBUG" -- \
  train-multinode.sbatch jobs/llama-350m.ini --eval-every 0
launched mpirun
opt -np 8
opt --map-by ppr:4:node:PE=8
for w in --report-bindings NCCL_DEBUG "$BIN"; do has "$w"; done
opt --config jobs/llama-350m.ini
opt --checkpoint-dir checkpoints/llama-350m
opt --resume auto
opt --eval-every 0
hasnt srun
[[ $OUT != *OMPI_MCA_pml* ]] || bad "mpirun was given a PML"
echo "ok: train-multinode dry run (LAUNCHER=mpirun): $OUT"
dry bad_launcher "${MULTI_ENV[@]}" SHARDTRAIN_BIN="$BIN" LAUNCHER=mpiexec -- train-multinode.sbatch jobs/llama-350m.ini
errs 2 "LAUNCHER='mpiexec'"

# train-gpu.sbatch: one GPU per rank; --device cuda only when the binary has the CUDA backend.
mkdir -p "$WORK/cpubin"
cat >"$WORK/cpubin/shardtrain" <<'EOF'
#!/bin/bash
# A stand-in for a CPU-only build of shardtrain (made without nvcc).
if [ "${1:-}" = --help ]; then printf '  --config arg\n  --device arg (=auto)\nCUDA backend: not built (no nvcc)\n'; exit 0; fi
exit 3
EOF
chmod +x "$WORK/cpubin/shardtrain"
dry gpu_cpu_build "${GPU_ENV[@]}" SHARDTRAIN_BIN="$WORK/cpubin/shardtrain" -- train-gpu.sbatch jobs/llama-125m.ini
launched srun
for w in --ntasks=8 --ntasks-per-node=4 --gpus-per-task=1; do has "$w"; done
opt --config jobs/llama-125m.ini
opt --resume auto
hasnt --device
grep -q "warning: .* has no CUDA backend" "$WORK/$CASE.err" || bad "no warning about the missing CUDA backend"
mkdir -p "$WORK/cudabin"
cat >"$WORK/cudabin/shardtrain" <<'EOF'
#!/bin/bash
# A stand-in for a CUDA build of shardtrain: its --help ends with "CUDA backend: built".
if [ "${1:-}" = --help ]; then printf '  --config arg\n  --device arg (=auto)\nCUDA backend: built (cuBLAS, NCCL; --device cuda)\n'; exit 0; fi
exit 3
EOF
chmod +x "$WORK/cudabin/shardtrain"
dry gpu_cuda_build "${GPU_ENV[@]}" SHARDTRAIN_BIN="$WORK/cudabin/shardtrain" -- train-gpu.sbatch jobs/llama-125m.ini
launched srun
has --gpus-per-task=1
opt --device cuda
[ "${W[-2]} ${W[-1]}" = "--device cuda" ] || bad "--device cuda is not last (pass-through options must come after it)"
! grep -q warning "$WORK/$CASE.err" || bad "warned although the binary has the CUDA backend"
dry gpu_device_given "${GPU_ENV[@]}" SHARDTRAIN_BIN="$WORK/cudabin/shardtrain" -- train-gpu.sbatch jobs/llama-125m.ini --device=cpu
launched srun
hasnt cuda
has --device=cpu
echo "ok: train-gpu dry run: --gpus-per-task=1, no --device and a warning for a CPU-only build; --device cuda for a" \
  "binary with the CUDA backend (unless given)"
# The real binary says which it is.
if [ -e "$(dirname "$BIN")/libshardtrain_cuda.so" ]; then "$BIN" --help | grep -q "CUDA backend: built" || bad "--help of a CUDA build"
else "$BIN" --help | grep -q "CUDA backend: not built" || bad "--help of a CPU-only build"; fi

# Array sweeps. One job file: --seed = SLURM_ARRAY_TASK_ID, checkpoints and metrics per task.
for s in "${TRAIN[@]}"; do
  dry "array_seed_${s%.sbatch}" "${ARRAY_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- "$s" jobs/small-test.ini
  launched srun
  opt --seed 3
  opt --checkpoint-dir checkpoints/small-test/seed_3
  opt --metrics checkpoints/small-test/seed_3/metrics.jsonl
  opt --resume auto
  opt --config jobs/small-test.ini
done
dry array_seed_metrics "${ARRAY_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch jobs/small-test.ini --metrics runs/m.jsonl
opt --metrics runs/m.seed_3.jsonl
dry array_seed_conflict "${ARRAY_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch jobs/small-test.ini --seed 9
errs 2 "--seed conflicts"
dry array_none "${ARRAY_ENV[@]}" SHARDTRAIN_BIN="$BIN" SHARDTRAIN_SWEEP=none -- train-cpu.sbatch jobs/small-test.ini
launched srun
hasnt --seed
opt --checkpoint-dir checkpoints/small-test
echo "ok: array task 3 with one job file (all 3 training scripts): --seed 3, --checkpoint-dir checkpoints/small-test/seed_3," \
  "metrics beside it; --seed on the command line is refused; SHARDTRAIN_SWEEP=none leaves the job file alone"

# A job file per index: 'DIR/%a.ini', a directory, or JOB_FILE=.../INDEX.ini (the task's own file).
mkdir -p "$WORK/sweep"
for i in 1 2 3 4; do
  sed -e "s|^checkpoint-dir = .*|checkpoint-dir = checkpoints/sweep-lr$i|" -e "s|^lr = .*|lr = ${i}e-3|" \
    -e "s|^metrics = .*|metrics = checkpoints/sweep-lr$i/metrics.jsonl|" "$JOBS/small-test.ini" >"$WORK/sweep/$i.ini"
done
for spec in "$WORK/sweep/%a.ini" "$WORK/sweep" "$WORK/sweep/"; do
  dry array_file "${ARRAY_ENV[@]}" SHARDTRAIN_BIN="$BIN" JOB_FILE="$spec" -- train-multinode.sbatch --steps 8
  launched srun
  opt --config "$WORK/sweep/3.ini"
  opt --checkpoint-dir checkpoints/sweep-lr3
  opt --steps 8
  hasnt --seed
  hasnt --metrics
done
dry array_file_literal "${ARRAY_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-gpu.sbatch "$WORK/sweep/3.ini"
launched srun
opt --config "$WORK/sweep/3.ini"
hasnt --seed
dry array_file_missing "${ARRAY_ENV[@]}" SLURM_ARRAY_TASK_ID=7 SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch "$WORK/sweep/%a.ini"
errs 2 "job file '$WORK/sweep/7.ini' not found"
dry pct_a_no_array "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch "$WORK/sweep/%a.ini"
errs 2 "not an array job"
echo "ok: array task 3 with a job file per index ('sweep/%a.ini', 'sweep', 'sweep/', '3.ini'): --config sweep/3.ini," \
  "its checkpoint-dir, no --seed; a missing index file and '%a' outside an array fail with status 2"

# Usage errors.
dry no_job_file "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch jobs/nonexistent.ini
errs 2 "job file 'jobs/nonexistent.ini' not found"
dry no_binary "${CPU_ENV[@]}" SHARDTRAIN_BIN="$WORK/nothing/shardtrain" -- train-cpu.sbatch jobs/small-test.ini
errs 2 "no executable shardtrain at '$WORK/nothing/shardtrain'"
dry bad_ntasks "${CPU_ENV[@]}" SLURM_NTASKS=x SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch jobs/small-test.ini
errs 2 "SLURM_NTASKS='x'"
echo "ok: a missing job file, a missing binary, a bad LAUNCHER or SLURM_NTASKS fail with status 2 and no command"

# A finished run (latest checkpoint at --steps) launches nothing and succeeds: a requeue or a
# resubmitted array does not fail on "nothing to train".
CK=$WORK/ck
mkdir -p "$CK"
touch "$CK/step_00000020.h5" "$CK/step_00000040.h5"
echo step_00000040.h5 >"$CK/latest"
dry finished "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch jobs/small-test.ini --checkpoint-dir "$CK"
{ [ "$RC" -eq 0 ] && [ -z "$OUT" ]; } || bad "expected exit 0 and no command"
grep -q "is at step 40 of 40: training is complete" "$WORK/$CASE.err" || bad "no 'training is complete' note"
dry not_finished "${CPU_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- train-cpu.sbatch jobs/small-test.ini --checkpoint-dir "$CK" --steps 60
launched srun
opt --resume auto
echo "ok: a run whose latest checkpoint is at --steps (40) exits 0 without launching; with --steps 60 it resumes"

# export.sbatch: the checkpoint 'latest' names, on one rank.
dry export "${ONE_ENV[@]}" SHARDTRAIN_BIN="$BIN" CKPT_DIR="$CK" -- export.sbatch jobs/small-test.ini --dtype bf16
want="srun --mpi=pmix --nodes=1 --ntasks=1 --cpus-per-task=4 --cpu-bind=cores $BIN --mode export $CK/step_00000040.h5"
want+=" --out $CK/hf/step_00000040 --dtype bf16"
launched srun
[ "$OUT" = "$want" ] || bad "command differs from: $want"
echo "ok: export dry run: $OUT"
echo step_00000020.h5 >"$CK/latest"
dry export_latest "${ONE_ENV[@]}" SHARDTRAIN_BIN="$BIN" -- export.sbatch jobs/small-test.ini --checkpoint-dir "$CK" --out "$WORK/hf"
launched srun
opt --mode export
has "$CK/step_00000020.h5"
opt --out "$WORK/hf"
hasnt --checkpoint-dir
hasnt --config
dry export_env "${ONE_ENV[@]}" SHARDTRAIN_BIN="$BIN" CKPT_DIR="$CK" EXPORT_DIR="$WORK/out" LAUNCHER=mpirun -- export.sbatch
launched mpirun
opt -np 1
opt --out "$WORK/out"
dry export_file "${ONE_ENV[@]}" SHARDTRAIN_BIN="$BIN" CHECKPOINT="$CK/step_00000040.h5" -- export.sbatch jobs/small-test.ini
launched srun
has "$CK/step_00000040.h5"
opt --out "$CK/hf/step_00000040"
mkdir -p "$WORK/sub/checkpoints/small-test/seed_3"
touch "$WORK/sub/checkpoints/small-test/seed_3/step_00000012.h5"
echo step_00000012.h5 >"$WORK/sub/checkpoints/small-test/seed_3/latest"
CASE=export_array RC=0
(cd "$WORK/sub" && env "${ARRAY_ENV[@]}" SLURM_NTASKS=1 SLURM_NTASKS_PER_NODE= SLURM_SUBMIT_DIR="$WORK/sub" SHARDTRAIN_BIN="$BIN" \
  SHARDTRAIN_DRYRUN=1 bash "$JOBS/export.sbatch" "$JOBS/small-test.ini") >"$WORK/$CASE.out" 2>"$WORK/$CASE.err" || RC=$?
OUT=$(cat "$WORK/$CASE.out")
read -r -a W <<<"$OUT"
launched srun
has checkpoints/small-test/seed_3/step_00000012.h5
opt --out checkpoints/small-test/seed_3/hf/step_00000012
dry export_no_latest "${ONE_ENV[@]}" SHARDTRAIN_BIN="$BIN" CKPT_DIR="$WORK/empty" -- export.sbatch jobs/small-test.ini
errs 2 "no '$WORK/empty/latest'"
echo "nothing.h5" >"$CK/latest"
dry export_dangling "${ONE_ENV[@]}" SHARDTRAIN_BIN="$BIN" CKPT_DIR="$CK" -- export.sbatch
errs 2 "names 'nothing.h5', which is not a file"
echo "ok: export: 'latest' picks the checkpoint (moved to step 20: step 20), --out / EXPORT_DIR / CHECKPOINT / CKPT_DIR," \
  "mpirun -np 1, array task 3's seed_3 directory; no or a dangling 'latest' fails with status 2"

# ---- 3. For real, with stand-ins: exit statuses, requeue, signals ----
FAKE=$WORK/fakebin
mkdir -p "$FAKE"
export FAKE_LOG=$WORK/fake.log STUB_PID=$WORK/stub.pid STUB_ARGS=$WORK/stub.args
cat >"$FAKE/srun" <<'EOF'
#!/bin/bash
# Stand-in for srun: logs its arguments, drops its own options (the scripts write them as --opt=value)
# and becomes the program, as one local "rank".
echo "srun $*" >>"$FAKE_LOG"
while [ $# -gt 0 ] && [[ $1 == -* ]]; do shift; done
exec "$@"
EOF
cat >"$FAKE/scontrol" <<'EOF'
#!/bin/bash
# Stand-in for scontrol: logs the call.
echo "scontrol $*" >>"$FAKE_LOG"
EOF
cat >"$FAKE/shardtrain" <<'EOF'
#!/bin/bash
# Stand-in for shardtrain. STUB_MODE=exit:N exits N; STUB_MODE=wait runs until SIGUSR1 or SIGTERM,
# then "saves a checkpoint" and exits 75, as shardtrain does.
if [ "${1:-}" = --help ]; then
  echo "  --config arg    INI job file"
  exit 0
fi
echo "$*" >"$STUB_ARGS"
echo $$ >"$STUB_PID"
case $STUB_MODE in
  exit:*) exit "${STUB_MODE#exit:}" ;;
  wait)
    trap 'echo "stub: got SIGUSR1" >>"$FAKE_LOG"; exit 75' USR1
    trap 'echo "stub: got SIGTERM" >>"$FAKE_LOG"; exit 75' TERM
    for ((i = 0; i < 600; i++)); do sleep 0.1; done
    exit 99
    ;;
esac
EOF
chmod +x "$FAKE"/*
SUB=$WORK/submit  # the submit directory: relative checkpoint and metrics paths land here
mkdir -p "$SUB"
REAL_ENV=("${CPU_ENV[@]}" SLURM_SUBMIT_DIR="$SUB" PATH="$FAKE:$PATH" SHARDTRAIN_BIN="$FAKE/shardtrain")

# start NAME SCRIPT ENV...: starts jobs/SCRIPT with jobs/small-test.ini in the background, from $SUB.
start() {
  CASE=$1
  local script=$JOBS/$2
  shift 2
  rm -f "$FAKE_LOG" "$STUB_PID" "$STUB_ARGS"
  (cd "$SUB" && exec env "${REAL_ENV[@]}" "$@" bash "$script" "$JOBS/small-test.ini" --steps 40) >"$WORK/$CASE.out" 2>"$WORK/$CASE.err" &
  SPID=$!
}
# finish: waits (at most 30 s) for the started script; sets RC.
finish() {
  local i
  for ((i = 0; i < 300; i++)); do
    kill -0 "$SPID" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$SPID" 2>/dev/null; then
    kill -9 "$SPID"
    [ -s "$STUB_PID" ] && kill -9 "$(cat "$STUB_PID")" 2>/dev/null
    fail "$CASE: the script did not finish within 30 s"
  fi
  RC=0
  wait "$SPID" || RC=$?
  OUT=$(cat "$WORK/$CASE.out")
}
requeued() { grep -qx "scontrol requeue $1" "$FAKE_LOG" 2>/dev/null; }
real_bad() {
  [ ! -s "$STUB_PID" ] || kill -9 "$(cat "$STUB_PID")" 2>/dev/null || true
  echo "--- $CASE: status ${RC:-}; fake log:" >&2
  cat "$FAKE_LOG" >&2 2>/dev/null
  cat "$WORK/$CASE.err" >&2
  fail "$CASE: $*"
}
wait_stub() {
  local i
  for ((i = 0; i < 100; i++)); do
    [ -s "$STUB_PID" ] && return 0
    sleep 0.1
  done
  real_bad "the stand-in shardtrain did not start"
}

start real_ok train-cpu.sbatch STUB_MODE=exit:0
finish
[ "$RC" -eq 0 ] || real_bad "exit status $RC after shardtrain's 0"
! requeued 4242 || real_bad "requeued a finished run"
grep -q -- "--config $JOBS/small-test.ini --checkpoint-dir checkpoints/small-test --resume auto --threads 8 --steps 40" "$STUB_ARGS" ||
  real_bad "shardtrain got '$(cat "$STUB_ARGS")'"
[ -d "$SUB/checkpoints/small-test" ] || real_bad "the checkpoint directory (and metrics' directory) was not created"
grep -q "^srun --mpi=pmix --nodes=1 --ntasks=4 " "$FAKE_LOG" || real_bad "srun was not called as printed"

start real_preempted train-cpu.sbatch STUB_MODE=exit:75
finish
[ "$RC" -eq 0 ] || real_bad "exit status $RC after shardtrain's 75, expected 0"
requeued 4242 || real_bad "no 'scontrol requeue 4242' after exit status 75"
grep -q "preempted (exit status 75)" "$WORK/$CASE.err" || real_bad "no 'preempted' note"

start real_no_requeue train-cpu.sbatch STUB_MODE=exit:75 SHARDTRAIN_REQUEUE=0
finish
{ [ "$RC" -eq 0 ] && ! requeued 4242; } || real_bad "SHARDTRAIN_REQUEUE=0: status $RC, or requeued"

for st in 1 3 137; do
  start "real_fail_$st" train-multinode.sbatch STUB_MODE=exit:$st
  finish
  [ "$RC" -eq "$st" ] || real_bad "exit status $RC after shardtrain's $st"
  ! requeued 4242 || real_bad "requeued after a failure (status $st)"
done
echo "ok: for real (stand-ins for srun, scontrol, shardtrain): status 0 -> exit 0, no requeue; 75 -> 'scontrol requeue" \
  "4242', exit 0 (SHARDTRAIN_REQUEUE=0: no requeue); 1, 3, 137 -> returned, no requeue; shardtrain got --resume auto"

# SIGTERM to every process of the job (preemption, time limit): the batch shell survives it and
# requeues after shardtrain's checkpoint exit.
start real_sigterm train-gpu.sbatch STUB_MODE=wait
wait_stub
kill -TERM "$SPID" "$(cat "$STUB_PID")"
finish
[ "$RC" -eq 0 ] || real_bad "exit status $RC after SIGTERM, expected 0"
grep -q "stub: got SIGTERM" "$FAKE_LOG" || real_bad "shardtrain did not get SIGTERM"
requeued 4242 || real_bad "no requeue after SIGTERM -> 75"
# SIGUSR1 to the batch shell only (--signal=B:USR1@120): forwarded to the launcher, then to the ranks.
start real_sigusr1 train-multinode.sbatch STUB_MODE=wait
wait_stub
kill -USR1 "$SPID"
finish
[ "$RC" -eq 0 ] || real_bad "exit status $RC after SIGUSR1, expected 0"
grep -q "stub: got SIGUSR1" "$FAKE_LOG" || real_bad "SIGUSR1 to the batch shell did not reach shardtrain"
requeued 4242 || real_bad "no requeue after SIGUSR1 -> 75"
# An array task requeues itself (its own SLURM_JOB_ID), not the whole array.
start real_array train-cpu.sbatch STUB_MODE=exit:75 "${ARRAY_ENV[@]}" SLURM_SUBMIT_DIR="$SUB"
finish
{ [ "$RC" -eq 0 ] && requeued 6003 && ! requeued 6000; } || real_bad "array task: status $RC, requeue calls: $(grep scontrol "$FAKE_LOG")"
grep -q -- "--seed 3" "$STUB_ARGS" || real_bad "array task: shardtrain got '$(cat "$STUB_ARGS")'"
[ -d "$SUB/checkpoints/small-test/seed_3" ] || real_bad "array task: no checkpoints/small-test/seed_3"
echo "ok: SIGTERM to the batch shell and shardtrain, and SIGUSR1 to the batch shell alone (forwarded), each end in exit 75," \
  "'scontrol requeue', exit 0; array task 3 of job 6000 requeues 6003 only"

# ---- 4. tests/slurm/run.sh where Slurm cannot start ----
# With no Slurm program on PATH it skips (exit 77, "slurm-test: skipped: ..."), and with
# SLURM_TEST_REQUIRE=1 the skip is a failure (exit 1): the test's own SLURM_TEST_* knobs survive its
# clean-up of inherited SLURM_* variables.
NOBIN=$WORK/nobin
mkdir -p "$NOBIN"
for t in bash dirname mktemp rm mkdir cat cp nproc date sleep grep sed awk head tail tr cut sort seq env kill ps; do
  p=$(command -v "$t") && ln -sf "$p" "$NOBIN/$t"
done
rc=0
out=$(env PATH="$NOBIN" BUILD="$BUILD" bash "$ROOT/tests/slurm/run.sh" 2>&1) || rc=$?
{ [ "$rc" -eq 77 ] && grep -q "^slurm-test: skipped: 'sbatch' not found" <<<"$out"; } ||
  { echo "$out"; fail "slurm test without Slurm: exit status $rc, expected 77 and a skip line"; }
rc=0
out=$(env PATH="$NOBIN" BUILD="$BUILD" SLURM_TEST_REQUIRE=1 bash "$ROOT/tests/slurm/run.sh" 2>&1) || rc=$?
{ [ "$rc" -eq 1 ] && grep -q "SLURM_TEST_REQUIRE=1: a skip counts as a failure" <<<"$out"; } ||
  { echo "$out"; fail "slurm test without Slurm, SLURM_TEST_REQUIRE=1: exit status $rc, expected 1"; }
echo "ok: tests/slurm/run.sh without Slurm: skipped (77); with SLURM_TEST_REQUIRE=1 a failure (1)"
