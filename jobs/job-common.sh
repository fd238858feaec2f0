# shellcheck shell=bash
# Shared by the sbatch scripts in jobs/ (train-cpu, train-multinode, train-gpu, export); sourced, not run.
#
# The calling script sets ST_ROOT (the repository), then calls st_train_main KIND ARGS... or
# st_export_main ARGS..., where ARGS are the script's own arguments: [JOB_FILE] [shardtrain options...].
#
# Environment (all optional):
#   JOB_FILE           job file when no first argument is given (default: jobs/small-test.ini)
#   SHARDTRAIN_BIN     the binary (default: build/shardtrain of this repository)
#   SHARDTRAIN_DRYRUN  1: print the launch command (one line, "srun ..." or "mpirun ...") and exit 0
#   LAUNCHER           srun (default) or mpirun; SRUN_MPI: srun's --mpi plugin (default pmix)
#   SHARDTRAIN_SRUN_PML  auto (default: Open MPI's UCX PML under srun where it exists, see st_srun_pml),
#                      ucx (required), default (leave Open MPI's choice); a set OMPI_MCA_pml wins
#   SRUN_ARGS, MPIRUN_ARGS  extra launcher options, split on spaces (e.g. MPIRUN_ARGS=--oversubscribe)
#   SHARDTRAIN_SWEEP   how an array job (sbatch --array) varies: auto (default), seed, file or none
#   SHARDTRAIN_REQUEUE 0: do not requeue after a preemption (exit status 75)
#   export only: CKPT_DIR (checkpoint directory), CHECKPOINT (a file instead of the latest), EXPORT_DIR
#
# Exit status of the training scripts: 0 when training finished, when it was already finished, or when
# shardtrain was preempted (status 75, checkpoint saved) and the job requeued itself; otherwise
# shardtrain's status (2 for a usage error of the script itself). A failure is never requeued, so a
# broken job does not loop.

ST_PREEMPTED=75  # shardtrain's exit status after SIGUSR1/SIGTERM: checkpoint saved, resume with --resume auto

st_note() { echo "shardtrain-job: $*" >&2; }
st_die() {
  echo "shardtrain-job: error: $*" >&2
  exit 2
}

# st_ini FILE KEY: the value of KEY in an INI job file, as Boost.ProgramOptions reads it ('#' starts a
# comment anywhere, key and value trimmed; keys after a [section] are not top-level). Status 1 if absent.
st_ini() {
  awk -v k="$2" '
    { sub(/\r$/, ""); sub(/#.*/, "") }
    /^[ \t]*\[/ { exit }
    {
      i = index($0, "="); if (!i) next
      key = substr($0, 1, i - 1); val = substr($0, i + 1)
      gsub(/^[ \t]+|[ \t]+$/, "", key); gsub(/^[ \t]+|[ \t]+$/, "", val)
      if (key == k) { print val; found = 1; exit }
    }
    END { exit !found }' "$1"
}

# st_extra NAME: the value of --NAME among the pass-through options ST_EXTRA ("--NAME V" or "--NAME=V";
# the last one). Status 1 if absent.
st_extra() {
  local i found=1 val=
  for ((i = 0; i < ${#ST_EXTRA[@]}; i++)); do
    case ${ST_EXTRA[i]} in
      "--$1")
        val=${ST_EXTRA[i + 1]:-}
        found=0
        ;;
      "--$1="*)
        val=${ST_EXTRA[i]#*=}
        found=0
        ;;
    esac
  done
  [ "$found" -eq 0 ] && printf '%s\n' "$val"
  return "$found"
}

# st_drop NAME: removes --NAME (and its value) from ST_EXTRA; the script passes its own value instead.
st_drop() {
  local i kept=()
  for ((i = 0; i < ${#ST_EXTRA[@]}; i++)); do
    case ${ST_EXTRA[i]} in
      "--$1") i=$((i + 1)) ;;
      "--$1="*) ;;
      *) kept+=("${ST_EXTRA[i]}") ;;
    esac
  done
  ST_EXTRA=("${kept[@]}")
}

# st_setup ARGS...: the binary, the job file (with array-job resolution), the pass-through options,
# the checkpoint directory and metrics file. Sets ST_BIN ST_JOB ST_EXTRA ST_SWEEP ST_TASK ST_CKDIR ST_METRICS.
st_setup() {
  ST_BIN=${SHARDTRAIN_BIN:-$ST_ROOT/build/shardtrain}
  [ -x "$ST_BIN" ] || st_die "no executable shardtrain at '$ST_BIN' (run 'make build', or set SHARDTRAIN_BIN)"
  local spec=
  if [ $# -gt 0 ] && [[ $1 != -* ]]; then
    spec=$1
    shift
  fi
  spec=${spec:-${JOB_FILE:-$ST_ROOT/jobs/small-test.ini}}
  ST_EXTRA=("$@")

  # Array jobs (sbatch --array=...): each task is one run of a sweep, with its own checkpoint
  # directory so that a requeued task resumes its own run. Two ways to vary the runs:
  #   file: a job file per index: JOB_FILE 'jobs/sweep/%a.ini' ('%a' = the index, as in sbatch's
  #         --output), a directory (its INDEX.ini), or a file named INDEX.ini;
  #   seed: one job file, --seed INDEX, checkpoints in CKPT_DIR/seed_INDEX (metrics alongside).
  # SHARDTRAIN_SWEEP=auto (default) picks 'file' for the forms above and 'seed' otherwise; 'none'
  # runs the job file unchanged in every task (then the job file must keep the tasks apart).
  ST_TASK=${SLURM_ARRAY_TASK_ID:-}
  ST_SWEEP=${SHARDTRAIN_SWEEP:-auto}
  case $ST_SWEEP in auto | seed | file | none) ;; *) st_die "SHARDTRAIN_SWEEP='$ST_SWEEP': expected auto, seed, file or none" ;; esac
  if [ -z "$ST_TASK" ]; then
    [[ $spec != *%a* ]] || st_die "job file '$spec' has '%a' (the array index) but this is not an array job (sbatch --array)"
    ST_SWEEP=none
    ST_JOB=$spec
  else
    [[ $ST_TASK =~ ^[0-9]+$ ]] || st_die "SLURM_ARRAY_TASK_ID='$ST_TASK' is not an index"
    local by_file=0
    if [[ $spec == *%a* ]] || [ -d "$spec" ] || [ "$(basename "$spec" .ini)" = "$ST_TASK" ]; then by_file=1; fi
    if [ "$ST_SWEEP" = auto ]; then
      if [ "$by_file" = 1 ]; then ST_SWEEP="file"; else ST_SWEEP="seed"; fi
    fi
    [ "$ST_SWEEP" != file ] || [ "$by_file" = 1 ] ||
      st_die "SHARDTRAIN_SWEEP=file needs a job file per index: 'DIR/%a.ini', a directory, or INDEX.ini"
    ST_JOB=${spec//%a/$ST_TASK}
    [ ! -d "$ST_JOB" ] || ST_JOB=${ST_JOB%/}/$ST_TASK.ini
  fi
  if [ ! -f "$ST_JOB" ] || [ ! -r "$ST_JOB" ]; then
    st_die "job file '$ST_JOB' not found (give it as the first argument or JOB_FILE)"
  fi

  # Checkpoint directory: the command line's, else the job file's, else checkpoints/<job file name>.
  ST_CKDIR=$(st_extra checkpoint-dir) || ST_CKDIR=$(st_ini "$ST_JOB" checkpoint-dir) || ST_CKDIR=
  [ -n "$ST_CKDIR" ] || ST_CKDIR=checkpoints/$(basename "$ST_JOB" .ini)
  ST_CKDIR=${ST_CKDIR%/}
  st_drop checkpoint-dir
  ST_METRICS=$(st_extra metrics) || ST_METRICS=$(st_ini "$ST_JOB" metrics) || ST_METRICS=
  if [ "$ST_SWEEP" = seed ]; then
    ! st_extra seed >/dev/null || st_die "--seed conflicts with the seed sweep of this array job (SHARDTRAIN_SWEEP=none to keep it)"
    local base=$ST_CKDIR
    ST_CKDIR=$base/seed_$ST_TASK
    if [ -n "$ST_METRICS" ]; then
      if [[ $ST_METRICS == "$base"/* ]]; then
        ST_METRICS=$ST_CKDIR/${ST_METRICS#"$base"/}
      elif [[ $ST_METRICS == *.jsonl ]]; then
        ST_METRICS=${ST_METRICS%.jsonl}.seed_$ST_TASK.jsonl
      else
        ST_METRICS=$ST_METRICS.seed_$ST_TASK
      fi
    fi
    st_drop metrics
  fi
}

# st_srun_pml: under srun, Open MPI's UCX PML instead of ob1 and its TCP BTL (appends an --export
# option to ST_CMD). Why: with Open MPI 4.1's ob1, a rank still waiting in MPI_Init's first PMIx fence
# can receive a peer's TCP fragment before ob1 has registered its receive callbacks, and calls an empty
# one: a segmentation fault at start-up, about 1 in 100 8-rank srun starts on a loaded machine
# (docs/slurm-startup-crash.md). Under the UCX PML no rank sends through a BTL. Left alone when the
# user chose a PML (OMPI_MCA_pml set), with SHARDTRAIN_SRUN_PML=default, when the user gives srun's
# --export (SRUN_ARGS or SLURM_EXPORT_ENV: theirs would replace or be replaced by ours), or when this
# Open MPI has no UCX PML (a warning; MPICH and others: nothing). pml_ucx_tls/devices=any let UCX run
# where it finds no InfiniBand (it then uses TCP and shared memory). A forced PML does not fall back:
# if UCX cannot run (a UCX_TLS naming a missing transport), MPI_Init fails with "PML ucx cannot be
# selected"; SHARDTRAIN_SRUN_PML=default then restores Open MPI's own choice.
st_srun_pml_mode() {
  local want=${SHARDTRAIN_SRUN_PML:-auto}
  case $want in
    auto | ucx | default) echo "$want" ;;
    *) st_die "SHARDTRAIN_SRUN_PML='$want': expected auto, ucx or default" ;;
  esac
}
st_srun_pml() {
  local want
  want=$(st_srun_pml_mode) || exit 2
  [ "$want" != default ] || return 0
  # not_added WHY: the PML is not set; a note (an error when SHARDTRAIN_SRUN_PML=ucx requires it).
  not_added() {
    [ "$want" != ucx ] || st_die "SHARDTRAIN_SRUN_PML=ucx: $1"
    [ -z "${2:-}" ] || st_note "$2: $1; srun starts may rarely crash in MPI_Init (docs/slurm-startup-crash.md)"
  }
  if [ -n "${OMPI_MCA_pml:-}" ]; then
    [ "$want" = auto ] || st_note "SHARDTRAIN_SRUN_PML=ucx ignored: OMPI_MCA_pml=$OMPI_MCA_pml is set"
    return 0
  fi
  if [ -n "${SLURM_EXPORT_ENV:-}" ] || [[ " ${SRUN_ARGS:-} " == *" --export"* ]]; then
    not_added "srun's --export is given (SRUN_ARGS or SLURM_EXPORT_ENV): the UCX PML is not added to it (export OMPI_MCA_pml=ucx yourself)" note
    return 0
  fi
  if ! command -v ompi_info >/dev/null 2>&1; then
    not_added "no ompi_info on PATH (not Open MPI?)"
    return 0
  fi
  local info rc=0
  info=$(timeout 30 ompi_info --parsable 2>/dev/null) || rc=$?
  if [ "$rc" -ne 0 ]; then
    not_added "'ompi_info --parsable' failed (status $rc; 124: not done in 30 s)" warning
    return 0
  fi
  if ! grep -q '^mca:pml:ucx:' <<<"$info"; then
    not_added "this Open MPI ($(command -v ompi_info)) has no UCX PML" warning
    return 0
  fi
  local ex=ALL,OMPI_MCA_pml=ucx
  [ -n "${OMPI_MCA_pml_ucx_tls:-}" ] || ex+=,OMPI_MCA_pml_ucx_tls=any
  [ -n "${OMPI_MCA_pml_ucx_devices:-}" ] || ex+=,OMPI_MCA_pml_ucx_devices=any
  ST_CMD+=("--export=$ex")
}

# st_launcher NTASKS EXTRA_SRUN_OPTIONS...: sets ST_CMD to the launcher part of the command.
st_launcher() {
  local n=$1 nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}} per_node=${SLURM_NTASKS_PER_NODE:-} cpus=${SLURM_CPUS_PER_TASK:-}
  shift
  local user=()
  st_srun_pml_mode >/dev/null || exit 2 # a bad SHARDTRAIN_SRUN_PML fails whatever the launch
  case ${LAUNCHER:-srun} in
    srun)
      # srun starts the ranks through Slurm's PMIx plugin (no mpirun). Since Slurm 22.05 srun does not
      # inherit --cpus-per-task from sbatch: pass it.
      ST_CMD=(srun "--mpi=${SRUN_MPI:-pmix}" "--nodes=$nodes" "--ntasks=$n")
      [ -z "$per_node" ] || ST_CMD+=("--ntasks-per-node=$per_node")
      [ -z "$cpus" ] || ST_CMD+=("--cpus-per-task=$cpus" --cpu-bind=cores)
      [ "$n" -le 1 ] || st_srun_pml # one rank receives no peer's message: nothing to avoid
      ST_CMD+=("$@")
      read -r -a user <<<"${SRUN_ARGS:-}"
      ;;
    mpirun)
      # Open MPI's mpirun inside the allocation reads the nodes and slots from Slurm itself. Each rank
      # gets its cores (PE=), so that its threads do not share one core.
      ST_CMD=(mpirun -np "$n")
      local map=
      if [ -n "$per_node" ]; then map=ppr:$per_node:node; fi
      if [ -n "$cpus" ] && [ "$cpus" -gt 1 ]; then map=${map:-slot}:PE=$cpus; fi
      [ -z "$map" ] || ST_CMD+=(--map-by "$map")
      read -r -a user <<<"${MPIRUN_ARGS:-}"
      ;;
    *) st_die "LAUNCHER='${LAUNCHER:-}': expected srun or mpirun" ;;
  esac
  ST_CMD+=("${user[@]}")
}

# st_ntasks: the number of ranks Slurm allocated (sbatch --ntasks, or --nodes x --ntasks-per-node).
st_ntasks() {
  local n=${SLURM_NTASKS:-${SLURM_NPROCS:-}}
  if [ -z "$n" ] && [ -n "${SLURM_NTASKS_PER_NODE:-}" ]; then
    n=$((${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}} * SLURM_NTASKS_PER_NODE))
  fi
  [[ ${n:-1} =~ ^[1-9][0-9]*$ ]] || st_die "SLURM_NTASKS='$n' is not a rank count"
  echo "${n:-1}"
}

# st_show: the command as one shell-quoted line (copy-paste runnable).
st_show() {
  local s
  s=$(printf '%q ' "$@")
  printf '%s\n' "${s% }"
}

# SIGTERM and Open MPI's mpirun (LAUNCHER=mpirun; Open MPI 4.1, Slurm 22.05; docs/slurm.md, "Preemption
# and requeue"). mpirun treats SIGTERM (like SIGINT and SIGHUP) as "abort the job": it sends its ranks
# SIGCONT, SIGTERM and SIGKILL, odls_base_sigkill_timeout (1 s) apart, and exits 1 about 2 s after the
# signal, while the ranks are still writing their preemption checkpoint. It cannot be told to
# forward SIGTERM instead (ess_base_forward_signals refuses SIGTERM, SIGINT and SIGHUP); it forwards
# SIGUSR1 and SIGUSR2, and shardtrain treats SIGUSR1 as SIGTERM (save the step, exit 75). Its daemons
# on other nodes (orted, started by srun as step 0) end their ranks the same way on SIGTERM.
# Where a SIGTERM reaches mpirun: `scancel --signal=TERM --full` signals the batch shell's process
# group, i.e. the shell and mpirun, but not the ranks (mpirun gives each rank a process group of its
# own) nor orted; a cancel (scancel without --signal, a preemption without GraceTime, `scontrol
# requeue`, the end of a GraceTime) sends SIGTERM to every process of every step (orted and all ranks
# included) and SIGKILL KillWait seconds later; a user may `kill` mpirun.
# So mpirun starts with SIGTERM blocked (jobs/sigterm-blocked: `env --block-signal=TERM`, else perl),
# and it starts orted so too (orte_launch_agent): their handlers never run, the signal stays pending.
# A blocked signal is inherited through exec, but Open MPI unblocks every signal in the ranks it
# starts, so a SIGTERM sent to the ranks still makes them save. The batch shell turns a SIGTERM into
# the SIGUSR1 that mpirun forwards to every rank: its own (the trap in st_run) or one pending in
# mpirun (st_term_pending, checked every second: a `kill` of mpirun alone).
# Left as it is: at a cancel, the srun that started orted gets SIGTERM too and asks Slurm to SIGKILL
# its tasks (Slurm's srun does that on SIGTERM); slurmstepd delivers that SIGKILL after the KillWait
# of the cancel in progress, so the ranks save in time, but mpirun may not return their 75 before it
# is killed (a multi-node job then shows no "preempted" line; the checkpoint is published, and
# Slurm requeues the job itself at a PreemptMode=REQUEUE preemption).

# st_sigblock: sets ST_SIGBLOCK to the command prefix that starts mpirun with SIGTERM blocked and has
# it start its daemons on other nodes (orted, through srun) so too: jobs/sigterm-blocked, and that as
# Open MPI's orte_launch_agent (unless the user set one). Empty, with a warning, when that cannot run.
st_sigblock() {
  ST_SIGBLOCK=()
  local blk=$ST_ROOT/jobs/sigterm-blocked
  if ! "$blk" true 2>/dev/null; then
    st_note "warning: '$blk' failed (missing, or neither 'env --block-signal' of coreutils >= 8.31 nor perl here): a SIGTERM to mpirun ends the ranks without a preemption save (send SIGUSR1 instead)"
    return 0
  fi
  ST_SIGBLOCK=("$blk")
  if [ -n "${OMPI_MCA_orte_launch_agent:-}" ] || [[ " ${MPIRUN_ARGS:-} " == *orte_launch_agent* ]]; then
    st_note "note: orte_launch_agent is set: mpirun's daemons on other nodes keep SIGTERM (a SIGTERM to them ends their ranks)"
  elif [[ $blk == *" "* ]]; then
    st_note "note: '$blk' has a space (Open MPI splits orte_launch_agent on spaces): mpirun's daemons on other nodes keep SIGTERM"
  else
    ST_SIGBLOCK=(env "OMPI_MCA_orte_launch_agent=$blk orted" "$blk")
  fi
}

# st_term_pending PID: PID has a SIGTERM pending (blocked, not yet delivered; /proc/PID/status ShdPnd).
st_term_pending() {
  local key val
  while read -r key val; do
    if [ "$key" = ShdPnd: ]; then
      [[ $val =~ ^[0-9a-fA-F]+$ ]] || return 1
      (((0x$val >> 14) & 1)) # bit 14: signal 15, SIGTERM
      return
    fi
  done 2>/dev/null <"/proc/$1/status"
  return 1
}

# st_running PID: PID is a live process (not gone, not a zombie waiting for `wait`).
st_running() {
  local key val
  while read -r key val; do
    [ "$key" != State: ] || { [[ $val != Z* ]]; return; }
  done 2>/dev/null <"/proc/$1/status"
  return 1
}

# st_run: runs ST_CMD in the background and waits for it; returns its exit status in ST_RC.
# The batch shell gets SIGTERM from Slurm at a preemption, at the time limit and on scancel, as all
# the job's processes do; the trap keeps it alive to read shardtrain's exit status. SIGUSR1 reaches
# the batch shell only with --signal=B:USR1@120 (see train-multinode.sbatch): it is forwarded to the
# launcher, and srun and mpirun both pass SIGUSR1 on to every rank. With mpirun, SIGTERM is blocked
# in mpirun and forwarded to it as SIGUSR1 (see "SIGTERM and Open MPI's mpirun" above).
st_run() {
  ST_SIGNALED=0
  ST_LAUNCHER_PID=
  ST_FORWARDED=0
  local mpirun=0 pre=()
  if [ "${ST_CMD[0]}" = mpirun ]; then
    mpirun=1
    st_sigblock
    pre=("${ST_SIGBLOCK[@]}")
    local also=
    [ "${pre[0]:-}" != env ] || also=", and its daemons on other nodes too"
    [ ${#pre[@]} -eq 0 ] || st_note "mpirun runs with SIGTERM blocked (jobs/sigterm-blocked)$also; a SIGTERM to this shell or to mpirun is passed to the ranks as SIGUSR1"
  fi
  if [ "$mpirun" = 1 ] && [ ${#pre[@]} -gt 0 ]; then
    trap 'ST_SIGNALED=1; st_note "batch shell got SIGTERM; forwarding it to mpirun as SIGUSR1"; st_usr1_launcher' TERM
  else
    trap 'ST_SIGNALED=1; st_note "batch shell got SIGTERM; waiting for shardtrain to save and exit"' TERM
  fi
  trap 'ST_SIGNALED=1; st_note "batch shell got SIGUSR1; forwarding it to the launcher"; st_usr1_launcher' USR1
  "${pre[@]}" "${ST_CMD[@]}" &
  ST_LAUNCHER_PID=$!
  if [ "$mpirun" = 1 ] && [ ${#pre[@]} -gt 0 ]; then
    # A SIGTERM sent to mpirun alone stays pending there: pass it on (once) as SIGUSR1.
    while st_running "$ST_LAUNCHER_PID"; do
      if [ "$ST_FORWARDED" = 0 ] && st_term_pending "$ST_LAUNCHER_PID"; then
        st_note "mpirun got SIGTERM; forwarding it to the ranks as SIGUSR1"
        st_usr1_launcher
      fi
      sleep 1 &
      wait $! 2>/dev/null || true
    done
  fi
  local rc=0 rc2
  wait "$ST_LAUNCHER_PID" || rc=$?
  # A trapped signal ends `wait` early (status > 128) while the launcher still runs: wait again.
  while [ "$ST_SIGNALED" = 1 ] && [ "$rc" -gt 128 ]; do
    ST_SIGNALED=0
    rc2=0
    wait "$ST_LAUNCHER_PID" || rc2=$?
    [ "$rc2" -eq 127 ] && break  # already reaped: rc was its real status
    rc=$rc2
  done
  trap - TERM USR1
  ST_RC=$rc
}

# st_usr1_launcher: SIGUSR1 to the launcher (srun and mpirun pass it on to every rank).
st_usr1_launcher() {
  [ -n "$ST_LAUNCHER_PID" ] || return 0
  ST_FORWARDED=1
  kill -USR1 "$ST_LAUNCHER_PID" 2>/dev/null || true
}

# st_train_main KIND ARGS...: KIND is cpu, multinode or gpu.
st_train_main() {
  local kind=$1
  shift
  st_setup "$@"
  local n
  n=$(st_ntasks) || exit 2

  # Already trained (e.g. a finished task of an array resubmitted, or a requeue after the last save):
  # shardtrain would refuse to resume a checkpoint at --steps, so stop here, successfully.
  local steps latest done_step
  steps=$(st_extra steps) || steps=$(st_ini "$ST_JOB" steps) || steps=100
  if ! st_extra resume >/dev/null && [ -f "$ST_CKDIR/latest" ]; then
    read -r latest <"$ST_CKDIR/latest" || true
    if [[ $latest =~ ^step_([0-9]+)\.h5$ ]] && [ -f "$ST_CKDIR/$latest" ]; then
      done_step=$((10#${BASH_REMATCH[1]}))
      if [[ $steps =~ ^[0-9]+$ ]] && [ "$done_step" -ge "$steps" ]; then
        st_note "'$ST_CKDIR/$latest' is at step $done_step of $steps: training is complete, nothing to run"
        exit 0
      fi
    fi
  fi

  local args=(--config "$ST_JOB" --checkpoint-dir "$ST_CKDIR")
  st_extra resume >/dev/null || args+=(--resume auto)
  if [ "$ST_SWEEP" = seed ]; then
    args+=(--seed "$ST_TASK")
    [ -z "$ST_METRICS" ] || args+=(--metrics "$ST_METRICS")
  fi
  # Threads per rank: the cores Slurm gave each task (shardtrain's own default reads the
  # task's affinity mask, which is the same with --cpu-bind=cores but the job's whole cgroup without).
  if [ -n "${SLURM_CPUS_PER_TASK:-}" ] && ! st_extra threads >/dev/null && ! st_ini "$ST_JOB" threads >/dev/null; then
    args+=(--threads "$SLURM_CPUS_PER_TASK")
  fi
  local srun_extra=()
  if [ "$kind" = gpu ]; then
    srun_extra=("--gpus-per-task=${SLURM_GPUS_PER_TASK:-1}")
    # Not `--help | grep -q`: with pipefail, grep's early exit can fail the pipeline (SIGPIPE).
    local help
    help=$("$ST_BIN" --help 2>/dev/null) || help=
    if grep -q -- 'CUDA backend: built' <<<"$help"; then
      st_extra device >/dev/null || st_ini "$ST_JOB" device >/dev/null || args+=(--device cuda)
    else
      st_note "warning: '$ST_BIN' has no CUDA backend (a CPU-only build): the ranks train on the CPU and the GPUs stay idle"
    fi
  fi
  st_launcher "$n" "${srun_extra[@]}"
  ST_CMD+=("$ST_BIN" "${args[@]}" "${ST_EXTRA[@]}")

  local what="job file '$ST_JOB'"
  [ "$ST_SWEEP" = none ] || what+=", array task $ST_TASK (sweep by $ST_SWEEP)"
  if [ "${SHARDTRAIN_DRYRUN:-0}" = 1 ]; then
    st_note "dry run: $n ranks, $what, checkpoints in '$ST_CKDIR'"
    st_show "${ST_CMD[@]}"
    exit 0
  fi

  mkdir -p "$ST_CKDIR"
  [ -z "$ST_METRICS" ] || mkdir -p "$(dirname "$ST_METRICS")"
  st_note "job ${SLURM_JOB_ID:-(not in Slurm)}, restart ${SLURM_RESTART_COUNT:-0}: $n ranks, $what, checkpoints in '$ST_CKDIR'"
  st_note "launching: $(st_show "${ST_CMD[@]}")"
  st_run
  case $ST_RC in
    0)
      st_note "training finished"
      exit 0
      ;;
    "$ST_PREEMPTED")
      # Preempted or warned of the time limit (SIGUSR1/SIGTERM): shardtrain saved a checkpoint and
      # exited 75. Put the job back in the queue; the next start resumes with --resume auto.
      st_note "preempted (exit status $ST_PREEMPTED): checkpoint saved in '$ST_CKDIR'"
      if [ "${SHARDTRAIN_REQUEUE:-1}" = 0 ]; then
        st_note "not requeueing (SHARDTRAIN_REQUEUE=0): submit again to resume"
      elif [ -z "${SLURM_JOB_ID:-}" ]; then
        st_note "not in a Slurm job: run again to resume"
      else
        # SLURM_JOB_ID is this array task's own id: only this task goes back to the queue.
        st_note "requeueing job $SLURM_JOB_ID: scontrol requeue $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" || st_note "warning: 'scontrol requeue $SLURM_JOB_ID' failed: submit again to resume"
      fi
      exit 0
      ;;
    *)
      st_note "shardtrain failed with exit status $ST_RC; not requeued"
      exit "$ST_RC"
      ;;
  esac
}

# st_export_main ARGS...: exports the latest checkpoint of the job's checkpoint directory on one rank.
st_export_main() {
  st_setup "$@"
  [ -z "${CKPT_DIR:-}" ] || ST_CKDIR=${CKPT_DIR%/}
  local ckpt=${CHECKPOINT:-} latest=
  if [ -z "$ckpt" ]; then
    # 'latest' names the newest published checkpoint; it moves only after a save completed.
    [ -f "$ST_CKDIR/latest" ] || st_die "no '$ST_CKDIR/latest': no checkpoint was published in '$ST_CKDIR' (set CKPT_DIR or CHECKPOINT)"
    read -r latest <"$ST_CKDIR/latest" || true
    if [ -z "$latest" ] || [ ! -f "$ST_CKDIR/$latest" ]; then
      st_die "'$ST_CKDIR/latest' names '$latest', which is not a file in '$ST_CKDIR'"
    fi
    ckpt=$ST_CKDIR/$latest
  fi
  [ -f "$ckpt" ] || st_die "checkpoint '$ckpt' not found"
  local out
  out=$(st_extra out) || out=${EXPORT_DIR:-$(dirname "$ckpt")/hf/$(basename "$ckpt" .h5)}
  st_drop out
  st_drop mode
  st_launcher 1
  ST_CMD+=("$ST_BIN" --mode export "$ckpt" --out "$out" "${ST_EXTRA[@]}")
  if [ "${SHARDTRAIN_DRYRUN:-0}" = 1 ]; then
    st_note "dry run: export of '$ckpt' to '$out'"
    st_show "${ST_CMD[@]}"
    exit 0
  fi
  st_note "exporting '$ckpt' to '$out': $(st_show "${ST_CMD[@]}")"
  local rc=0
  "${ST_CMD[@]}" || rc=$?
  [ "$rc" -ne 0 ] || st_note "export written to '$out' (load it with transformers.AutoModelForCausalLM.from_pretrained)"
  exit "$rc"
}
