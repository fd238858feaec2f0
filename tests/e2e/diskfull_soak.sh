#!/usr/bin/env bash
# The disk-full test's mid-write case under load, many times (issue 53, item 2; not part of make
# test: it loads the machine for minutes). test_checkpoint_diskfull.sh's `shim_midwrite` once timed
# out under load (both ranks' watchdogs fired after 20 s in the guarded HDF5 section of the final
# save); this tells a hang from slowness: the watchdog is raised to WATCHDOG seconds and the
# wrapper's timeout put above it, so a run that is only slow finishes and says how long it took,
# and a run still going after STACK_AT seconds has each rank's stacks taken with gdb (twice,
# STACK_GAP seconds apart: the same frames twice is a hang, different ones a slow save).
#
# Usage: bash tests/e2e/diskfull_soak.sh BUILD [RUNS=30]
# Environment (defaults): CASE=shim (shim_midwrite; tmpfs: tmpfs_midwrite, a real small tmpfs filled
#   to leave half a checkpoint free, needs root), WATCHDOG=120 (--collective-timeout; the wrapper is timeout -k 5
#   WATCHDOG+30), LOAD=1 (0: no load), BUSY=2 (busy loops), COMPILES=1 (loops compiling
#   src/io/checkpoint_data.cpp into $WORK), LOAD_MIN=8 (wait, at most 120 s, for the 1-minute load
#   average to reach it before the first run), STACK_AT=25, STACK_GAP=15, OUT=/tmp/diskfull-soak.N
#   (logs and stacks kept there), MIDWRITE_ARGS (more options for the failing run).
# Prints per run: outcome (pass, or why not), exit status, wall time, the load average at its start
# and, for a run past STACK_AT, each rank's main-thread stack; at the end the outcome counts and the
# times' minimum, median and maximum. Exit status 1 if any run did not pass.
#
# The cases are test_checkpoint_diskfull.sh's shim_midwrite and tmpfs_midwrite (keep ARGS and the
# disk's settings equal to its): every rank sees a disk with half a checkpoint free (the shim,
# tests/e2e/enospc_shim.c, or a tmpfs), the space reservation skipped, so the writes fail half-way;
# the job must exit 1 on every rank with the message naming the .tmp, `latest` and step 2
# unchanged, nothing left behind.
source "$(dirname "$0")/common.sh"
RUNS=${2:-30}
WATCHDOG=${WATCHDOG:-120}
WRAP=$((${WATCHDOG%.*} + 30))
LOAD=${LOAD:-1} BUSY=${BUSY:-2} COMPILES=${COMPILES:-1} LOAD_MIN=${LOAD_MIN:-8}
STACK_AT=${STACK_AT:-25} STACK_GAP=${STACK_GAP:-15}
OUT=${OUT:-$(mktemp -d /tmp/diskfull-soak.XXXXXX)}
mkdir -p "$OUT"
read -r -a MORE <<<"${MIDWRITE_ARGS:-}"
DATA=$(test_corpus)
ARGS=(--model tiny --data "$DATA" --seq-len 16 --global-batch 4 --steps 4 --eval-every 0 --eval-batches 1 --threads 1)
SHIM=$WORK/enospc_shim.so
cc -shared -fPIC -O1 -o "$SHIM" "$ROOT/tests/e2e/enospc_shim.c" -ldl || fail "cannot compile the ENOSPC shim"

LOADERS=()
stop_load() {
  local p
  for p in "${LOADERS[@]}"; do kill -- "-$p" 2>/dev/null || true; done  # each loop is its own process group (setsid)
  for p in "${LOADERS[@]}"; do while kill -0 "$p" 2>/dev/null; do sleep 0.1; done; done
  LOADERS=()
}
trap 'rc=$?; stop_load; umount -l "$WORK/small" 2>/dev/null; rm -rf "$WORK"; exit $rc' EXIT  # (the campaign's status, not umount's)
trap 'exit 130' INT TERM

# The published step 2, made once without load; every run starts from a copy of it.
SEED=$WORK/seed
timeout -k 5 60 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --checkpoint-dir "$SEED" --stop-at-step 2 >"$OUT/first.log" 2>&1 \
  || { cat "$OUT/first.log"; fail "first checkpoint"; }
size=$(stat -c %s "$SEED/step_00000002.h5")
sum=$(sha256sum <"$SEED/step_00000002.h5")
CASE=${CASE:-shim}
case $CASE in
  shim) ;;
  tmpfs)
    mkdir -p "$WORK/small"
    mount -t tmpfs -o size=$((size * 5 / 1024 + 64))k tmpfs "$WORK/small" || fail "cannot mount a tmpfs (CASE=tmpfs needs root)" ;;
  *) fail "CASE must be shim or tmpfs, not '$CASE'" ;;
esac

if [ "$LOAD" = 1 ]; then
  for ((i = 0; i < BUSY; i++)); do
    setsid bash -c 'while :; do :; done' &
    LOADERS+=($!)
  done
  CXXFLAGS_LOAD=(-DOMPI_SKIP_MPICXX=1 -I"$ROOT/include" -isystem /usr/include/hdf5/openmpi -std=c++20 -O2 -g)
  for ((i = 0; i < COMPILES; i++)); do
    setsid bash -c 'while :; do mpicxx "$@" -c "'"$ROOT"'/src/io/checkpoint_data.cpp" -o "'"$WORK"'/load'$i'.o" || sleep 1; done' \
      _ "${CXXFLAGS_LOAD[@]}" &
    LOADERS+=($!)
  done
  t0=$SECONDS
  while (($(awk '{ print int($1) }' /proc/loadavg) < LOAD_MIN && SECONDS - t0 < 120)); do sleep 2; done
  echo "load: $BUSY busy loops, $COMPILES compile loops; load average after $((SECONDS - t0)) s: $(cut -d' ' -f1-3 /proc/loadavg)"
else
  echo "load: none started; load average $(cut -d' ' -f1-3 /proc/loadavg)"
fi
echo "case ${CASE}_midwrite ($size-byte checkpoint, $((size / 2)) bytes free), --collective-timeout $WATCHDOG, wrapper timeout -k 5 $WRAP, $RUNS runs; logs in $OUT"

# rank_pids MPIRUN_PARENT: "RANK:PID" for each rank of the job under this timeout process.
rank_pids() {
  local m r p
  for m in $(pgrep -P "$1"); do
    for p in $(pgrep -P "$m"); do
      r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
      [ -n "$r" ] && echo "$r:$p"
    done
  done
}

# stacks TAG TIMEOUT_PID: every thread's stack of each rank into $OUT/TAG.rR.bt; prints each rank's
# main thread as "rank R: f1 < f2 < ..." (innermost first, shardtrain/HDF5/MPI frames).
stacks() {
  local tag=$1 rp r p
  for rp in $(rank_pids "$2"); do
    r=${rp%%:*} p=${rp#*:}
    timeout 60 gdb -batch -p "$p" -ex 'thread apply all bt' >"$OUT/$tag.r$r.bt" 2>&1 || true
    echo "    rank $r (pid $p): $(awk '/^Thread /{ t = /^Thread 1 / } t && /^#/ { f = $2; if (f ~ /^0x/) f = $4; print f }' \
      "$OUT/$tag.r$r.bt" | grep -v '^??$' | head -14 | paste -sd'<' | sed 's/</ < /g')"
  done
}

# judge LOG RC DIR: "pass" or why the run is not one (test_checkpoint_diskfull.sh's expect_diskfull).
judge() {
  local log=$1 rc=$2 dir=$3 r
  [ "$rc" -ne 0 ] || { echo "exit 0"; return; }
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || { echo "wrapper timeout ($WRAP s)"; return; }
  ! grep -q "has not completed after" "$log" || { echo "watchdog: $(grep -m1 -o 'collective .* has not completed after [0-9]* s' "$log")"; return; }
  [ "$rc" -ne 139 ] && ! grep -q "signal 11\|Segmentation fault\|exited on signal" "$log" || { echo "crash"; return; }
  for r in 0 1; do
    grep -q "error \[rank $r/2\]: .*/\.step_00000004\.h5\.[A-Za-z0-9._-]*\.[0-9]*\.tmp'" "$log" || { echo "rank $r: no error naming the file"; return; }
  done
  grep -q "error \[rank 0/2\]: .*writing .* failed: No space left on device" "$log" || { echo "message lacks ENOSPC"; return; }
  grep -q "error \[rank 0/2\]: .*KiB free" "$log" || { echo "message lacks the free space"; return; }
  [ "$(cat "$dir/latest")" = "step_00000002.h5" ] || { echo "latest moved"; return; }
  [ "$(sha256sum <"$dir/step_00000002.h5")" = "$sum" ] || { echo "step 2 changed"; return; }
  [ -z "$(ls -A "$dir" | grep -v '^step_00000002.h5$\|^latest$\|^\.shardtrain\.lock$')" ] || { echo "files left behind"; return; }
  echo pass
}

declare -A COUNT
TIMES=()
for ((n = 1; n <= RUNS; n++)); do
  log=$OUT/run$n.log rc=0
  if [ "$CASE" = shim ]; then
    dir=$WORK/run$n
    rm -rf "$WORK/run$((n - 1))"
    cp -a "$SEED" "$dir"
    disk=(LD_PRELOAD="$SHIM" ENOSPC_SHIM_DIR="$(realpath "$dir")" ENOSPC_SHIM_LIMIT=$((size / 2)))
  else  # the tmpfs with step 2 and latest, filled to leave half a checkpoint free
    dir=$WORK/small/ck
    rm -rf "$dir" "$WORK/small/filler"
    cp -a "$SEED" "$dir"
    free=$(df -B1 --output=avail "$WORK/small" | tail -1 | tr -d ' ')
    head -c $((free - size / 2)) /dev/zero >"$WORK/small/filler" 2>/dev/null || true
    disk=(LD_PRELOAD= ENOSPC_SHIM_DIR= ENOSPC_SHIM_LIMIT=)
  fi
  la=$(cut -d' ' -f1 /proc/loadavg)
  t0=$EPOCHREALTIME
  env "${disk[@]}" SHARDTRAIN_TEST_SKIP_SPACE_CHECK=1 \
    timeout -k 5 "$WRAP" $MPIRUN -np 2 -x LD_PRELOAD -x ENOSPC_SHIM_DIR -x ENOSPC_SHIM_LIMIT -x SHARDTRAIN_TEST_SKIP_SPACE_CHECK \
    "$BIN" "${ARGS[@]}" --collective-timeout "$WATCHDOG" "${MORE[@]}" --checkpoint-dir "$dir" --resume auto >"$log" 2>&1 &
  tpid=$!
  taken=0 st=""
  while kill -0 "$tpid" 2>/dev/null; do
    el=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print int(b - a) }')
    if [ "$taken" -eq 0 ] && [ "$el" -ge "$STACK_AT" ]; then
      st+="  stacks at ${el} s:"$'\n'"$(stacks "run$n.a" "$tpid")"$'\n'
      taken=1
    elif [ "$taken" -eq 1 ] && [ "$el" -ge $((STACK_AT + STACK_GAP)) ]; then
      st+="  stacks at ${el} s:"$'\n'"$(stacks "run$n.b" "$tpid")"$'\n'
      taken=2
    fi
    sleep 0.2
  done
  wait "$tpid" || rc=$?
  took=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  outcome=$(judge "$log" "$rc" "$dir")
  COUNT[$outcome]=$((${COUNT[$outcome]:-0} + 1))
  TIMES+=("$took")
  what=$(grep -m1 -o 'error \[rank 0/2\]: .*' "$log" | grep -o 'rank [0-9]*: \|writing [^:]*\|reserving\|has not completed after [0-9]* s' | paste -sd' ' || true)
  printf 'run %2d: %-10s exit %3d  %6s s  load %-5s  %s\n' "$n" "$outcome" "$rc" "$took" "$la" "$what"
  [ -z "$st" ] || printf '%s' "$st"
done
stop_load
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
for k in "${!COUNT[@]}"; do echo "outcome '$k': ${COUNT[$k]} of $RUNS"; done
printf '%s\n' "${TIMES[@]}" | sort -g | awk '{ t[NR] = $1 } END { printf "wall time: min %s s, median %s s, max %s s\n", t[1], t[int((NR + 1) / 2)], t[NR] }'
[ "${COUNT[pass]:-0}" -eq "$RUNS" ]
