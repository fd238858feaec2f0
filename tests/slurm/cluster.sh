# shellcheck shell=bash
# A private two-node Slurm cluster on this machine, for tests/slurm/run.sh; sourced, not run.
#
# cluster_start DIR: writes DIR/slurm.conf (free private ports, state/spool/tmp/log folders in DIR),
#   starts munged (its own key and socket in DIR; auth/none when munged is absent), slurmctld and two
#   slurmd (-N n1, -N n2: emulated nodes of 4 CPUs each on this host, whatever its
#   core count) in the foreground mode (-D),
#   as children of this shell, and waits (CLUSTER_START_TIMEOUT s, default 30) until both nodes are
#   idle. Exports SLURM_CONF. CLUSTER_UTS=1 when each slurmd (and so each job's processes on that
#   node) runs in a UTS namespace whose host name is the node's name (n1, n2); 0 when this machine
#   does not allow it, or CLUSTER_NO_UTS=1 (then both nodes have this host's name). Status 0 when the cluster is up; otherwise status 1 and CLUSTER_WHY says
#   why (the caller skips). CLUSTER_T0: the time slurmctld was started (its 30-s timers count from it).
# cluster_stop: cancels this cluster's jobs, stops the daemons it started by their PIDs (SIGTERM, then
#   SIGKILL after 5 s), ends any process still carrying this cluster's SLURM_CONF in its environment
#   (a job's process: only this cluster's jobs have it) and says so; prints one line stating whether any
#   of the PIDs is still alive. Safe to call twice, and from an EXIT trap.
#
# Processes not started here are never signalled: there is no pkill/killall, only PIDs this shell got
# from `$!`, and those of processes whose environment names this cluster's own slurm.conf.

# Set here, read by the caller.
# shellcheck disable=SC2034
{
  CLUSTER_PIDS=() # "name:pid" of each daemon started
  CLUSTER_DIR=
  CLUSTER_WHY=
  CLUSTER_T0=
  CLUSTER_UTS=0
}

# _cl_port_free PORT: nothing listens on PORT (TCP, any address) and nothing is connected from it.
_cl_port_free() {
  if command -v ss >/dev/null; then
    ! ss -Htan 2>/dev/null | awk '{ print $4 }' | grep -qE "[:.]$1\$"
  else
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}

# _cl_pick_ports: CL_PORT (slurmctld) and CL_PORT+1, CL_PORT+2 (slurmd n1, n2), all free.
_cl_pick_ports() {
  local try base
  for ((try = 0; try < 50; try++)); do
    base=$((20000 + (RANDOM % 2000) * 16))
    if _cl_port_free "$base" && _cl_port_free $((base + 1)) && _cl_port_free $((base + 2)); then
      CL_PORT=$base
      return 0
    fi
  done
  return 1
}

_cl_alive() { kill -0 "$1" 2>/dev/null; }

# _cl_dead_daemon: the name of a started daemon that has exited, if any (status 0 if one did).
_cl_dead_daemon() {
  local e
  for e in "${CLUSTER_PIDS[@]}"; do
    _cl_alive "${e#*:}" || {
      echo "${e%%:*}"
      return 0
    }
  done
  return 1
}

cluster_start() {
  CLUSTER_DIR=$1
  local d=$CLUSTER_DIR b host auth
  for b in slurmctld slurmd sbatch srun scontrol squeue sinfo scancel; do
    command -v "$b" >/dev/null || {
      CLUSTER_WHY="'$b' not found (make deps installs slurmctld slurmd slurm-client munge)"
      return 1
    }
  done
  _cl_pick_ports || {
    CLUSTER_WHY="no free TCP ports for slurmctld and two slurmd"
    return 1
  }
  host=$(hostname -s)
  mkdir -p "$d"/{state,spool,tmp/n1,tmp/n2,run,log,munge}
  chmod 755 "$d" "$d/munge"
  if command -v munged >/dev/null; then
    auth="AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$d/munge/munge.socket.2"
  else
    auth="AuthType=auth/none
CredType=cred/none"
  fi
  # Each emulated node's tasks get a temporary folder of their own, per job, as on separate machines
  # (or under job_container/tmpfs): both nodes share this host's /tmp and /dev/shm, and Open MPI keeps
  # its session directories (TMPDIR) and shared-memory segments (btl_vader_backing_directory) there.
  # slurmstepd runs the TaskProlog before every task, the batch script included, and applies the
  # "export NAME=VALUE" lines it prints to the task's environment.
  cat >"$d/task-prolog.sh" <<EOF
#!/bin/sh
t=$d/tmp/\${SLURMD_NODENAME:-unknown}/job\${SLURM_JOB_ID:-0}
mkdir -p "\$t" && echo "export TMPDIR=\$t" && echo "export OMPI_MCA_btl_vader_backing_directory=\$t"
EOF
  chmod 755 "$d/task-prolog.sh"
  cat >"$d/slurm.conf" <<EOF
# Written by tests/slurm/cluster.sh: a private cluster of two emulated nodes on $host.
ClusterName=shardtrain-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=$(id -un)
SlurmdUser=root
$auth
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SlurmctldPort=$CL_PORT
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool/%n
TmpFS=$d/tmp/%n
TaskProlog=$d/task-prolog.sh
SlurmctldPidFile=$d/run/slurmctld.pid
SlurmdPidFile=$d/run/slurmd-%n.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd-%n.log
# The node sizes below are the test's, not this machine's (both emulated nodes share its cores):
# config_overrides keeps slurmd from draining a node that has fewer CPUs than configured.
SlurmdParameters=config_overrides
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=4
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 CPUs=4 RealMemory=2000 Port=$((CL_PORT + 1))-$((CL_PORT + 2)) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$d/slurm.conf
  if command -v munged >/dev/null; then
    # Its own key (munged refuses a key that others can read) and socket: no system munged needed.
    if command -v mungekey >/dev/null; then
      mungekey -c -k "$d/munge/munge.key" >/dev/null 2>&1 || dd if=/dev/urandom of="$d/munge/munge.key" bs=1024 count=1 status=none
    else
      dd if=/dev/urandom of="$d/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 600 "$d/munge/munge.key"
    munged -F --force --socket="$d/munge/munge.socket.2" --key-file="$d/munge/munge.key" \
      --log-file="$d/log/munged.log" --pid-file="$d/run/munged.pid" --seed-file="$d/munge/seed" \
      >"$d/log/munged.out" 2>&1 &
    CLUSTER_PIDS+=("munged:$!")
    local i
    for ((i = 0; i < 50; i++)); do
      [ -S "$d/munge/munge.socket.2" ] && break
      sleep 0.1
    done
    [ -S "$d/munge/munge.socket.2" ] || {
      CLUSTER_WHY="munged did not create its socket within 5 s ($(tail -n 2 "$d/log/munged.log" "$d/log/munged.out" 2>/dev/null | tr '\n' ' '))"
      return 1
    }
  fi
  CLUSTER_T0=$(date +%s)
  slurmctld -D -f "$SLURM_CONF" >"$d/log/slurmctld.out" 2>&1 &
  CLUSTER_PIDS+=("slurmctld:$!")
  # Each slurmd in a UTS namespace of its own, with its node's name as host name, where this machine
  # allows it (root, no seccomp filter against unshare): the jobs then see two hosts, as on a real
  # cluster (Open MPI tells nodes apart by host name, e.g. in the names of its shared-memory files).
  CLUSTER_UTS=0
  if [ "${CLUSTER_NO_UTS:-0}" != 1 ] && command -v unshare >/dev/null && unshare --uts true 2>/dev/null; then CLUSTER_UTS=1; fi
  local n
  for n in n1 n2; do
    if [ "$CLUSTER_UTS" = 1 ]; then
      # unshare and sh exec: the PID is slurmd's.
      # shellcheck disable=SC2016 # expanded by that sh
      unshare --uts sh -c 'hostname "$1" && exec slurmd -D -N "$1" -f "$2"' sh "$n" "$SLURM_CONF" >"$d/log/slurmd-$n.out" 2>&1 &
    else
      slurmd -D -N "$n" -f "$SLURM_CONF" >"$d/log/slurmd-$n.out" 2>&1 &
    fi
    CLUSTER_PIDS+=("slurmd-$n:$!")
  done
  local t_end=$((SECONDS + ${CLUSTER_START_TIMEOUT:-30})) idle dead
  while :; do
    if dead=$(_cl_dead_daemon); then
      CLUSTER_WHY="$dead exited at start-up: $(tail -n 3 "$d/log/$dead.log" "$d/log/$dead.out" 2>/dev/null | grep -v '^==>' | tr '\n' ' ')"
      return 1
    fi
    idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$')
    [ "$idle" -ge 2 ] && break
    if [ "$SECONDS" -ge "$t_end" ]; then
      CLUSTER_WHY="the two nodes were not idle within ${CLUSTER_START_TIMEOUT:-30} s (sinfo: $(sinfo -h -N -o '%N %t %E' 2>&1 | tr '\n' ' '))"
      return 1
    fi
    sleep 0.3
  done
  return 0
}

# _cl_descends PID: PID is this shell or one of its descendants (the daemons, sbatch clients, subshells).
_cl_descends() {
  local p=$1 stat
  while [ "$p" -gt 1 ]; do
    [ "$p" != "$$" ] || return 0
    stat=$(cat "/proc/$p/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    read -r _ p _ <<<"$stat"
  done
  return 1
}

# _cl_job_pids: PIDs of processes whose environment has SLURM_CONF=<this cluster's slurm.conf> and
# that do not descend from this shell: the processes of this cluster's jobs (slurmstepd daemonizes,
# so they are not our children). No other process has this temporary path in its environment.
_cl_job_pids() {
  local p
  [ -n "$CLUSTER_DIR" ] || return 0
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    { tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$CLUSTER_DIR/slurm.conf" || continue
    _cl_descends "$p" || echo "$p"
  done
}

cluster_stop() {
  [ ${#CLUSTER_PIDS[@]} -gt 0 ] || return 0
  local e pid i alive=() left t0=$SECONDS
  # (Only while slurmctld runs, and bounded: a timeout signals this whole process group, daemons
  # included, and the clients of a controller that is going down retry for many seconds.)
  local ctld='' t_end out
  for e in "${CLUSTER_PIDS[@]}"; do [ "${e%%:*}" != slurmctld ] || ctld=${e#*:}; done
  if command -v scancel >/dev/null && [ -n "${SLURM_CONF:-}" ] && [ -n "$ctld" ] && _cl_alive "$ctld"; then
    # Cancel this cluster's jobs first, so that no job outlives its slurmd.
    timeout 5 scancel --quiet --user="$(id -un)" >/dev/null 2>&1 || true
    t_end=$((SECONDS + 10))
    while [ "$SECONDS" -lt "$t_end" ]; do
      out=$(timeout 3 squeue -h -o %A 2>/dev/null) || break
      [ -n "$out" ] || break
      sleep 0.25
    done
  fi
  # slurmd first, then slurmctld, then munged (they authenticate through it until the end).
  for name in slurmd-n1 slurmd-n2 slurmctld munged; do
    for e in "${CLUSTER_PIDS[@]}"; do
      [ "${e%%:*}" = "$name" ] || continue
      pid=${e#*:}
      _cl_alive "$pid" || continue
      kill -TERM "$pid" 2>/dev/null
      for ((i = 0; i < 50; i++)); do
        _cl_alive "$pid" || break
        sleep 0.1
      done
      if _cl_alive "$pid"; then
        echo "cluster: $name (PID $pid) ignored SIGTERM for 5 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null
      fi
      wait "$pid" 2>/dev/null
    done
  done
  left=$(_cl_job_pids | tr '\n' ' ')
  if [ -n "$left" ]; then
    echo "cluster: processes of this cluster's jobs still running after its daemons stopped: $left- SIGKILL"
    # shellcheck disable=SC2086 # a list of PIDs
    kill -KILL $left 2>/dev/null
    sleep 0.5
  fi
  for e in "${CLUSTER_PIDS[@]}"; do _cl_alive "${e#*:}" && alive+=("$e"); done
  left=$(_cl_job_pids | tr '\n' ' ')
  if [ ${#alive[@]} -eq 0 ] && [ -z "$left" ]; then
    echo "cluster: stopped ${CLUSTER_PIDS[*]} in $((SECONDS - t0)) s: none of these PIDs is alive, no process with this cluster's SLURM_CONF left"
    CLUSTER_PIDS=()
    return 0
  fi
  echo "cluster: ERROR: still alive: ${alive[*]} ${left:+(job processes $left)}"
  CLUSTER_PIDS=()
  return 1
}
