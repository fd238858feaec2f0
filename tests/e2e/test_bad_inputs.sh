#!/usr/bin/env bash
# Rows of docs/errors.md not covered by the other scripts: a full checkpoint disk (a 400 KiB tmpfs),
# a corpus shorter than one sequence, a missing corpus. Each: one clear message, non-zero exit on
# every rank, and no published checkpoint touched.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
ARGS=(--model tiny --data "$DATA" --seq-len 16 --global-batch 4 --steps 4 --eval-batches 1 --threads 1)

mkdir -p "$WORK/small"
if mount -t tmpfs -o size=600k tmpfs "$WORK/small" 2>/dev/null; then
  trap 'umount -l "$WORK/small" 2>/dev/null; rm -rf "$WORK"' EXIT
  timeout -k 5 60 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --checkpoint-dir "$WORK/small/ck" --stop-at-step 2 >"$WORK/first.log" 2>&1 \
    || { cat "$WORK/first.log"; fail "first checkpoint on the small disk"; }
  sum=$(sha256sum "$WORK/small/ck/step_00000002.h5")
  expect_fail disk_full "': not enough space in '$WORK/small/ck'" 2 "${ARGS[@]}" --checkpoint-dir "$WORK/small/ck" --resume auto
  # The file named is the save's temporary, tagged with rank 0's host and process id.
  host=$(hostname | tr -c 'A-Za-z0-9.\n-' '-')
  grep -qE "error \[rank 0/2\]: checkpoint '$WORK/small/ck/\.step_00000004\.h5\.$host(_pidns[0-9]+)?\.[1-9][0-9]*\.tmp': not enough space in '$WORK/small/ck'" \
    "$WORK/disk_full.log" || { cat "$WORK/disk_full.log"; fail "disk_full: the message does not name '.step_00000004.h5.$host.<pid>.tmp'"; }
  # Without the up-front reservation the write fails half-way: the ranks agree on the failure and
  # exit 1 (test_checkpoint_diskfull.sh checks this in detail; the watchdog is only a backstop).
  rc=0
  SHARDTRAIN_TEST_SKIP_SPACE_CHECK=1 timeout -k 5 60 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --checkpoint-dir "$WORK/small/ck" \
    --resume auto --collective-timeout 5 >"$WORK/mid.log" 2>&1 || rc=$?
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || { cat "$WORK/mid.log"; fail "disk full mid-write: exit status $rc"; }
  grep -q "writing .* failed: No space left on device" "$WORK/mid.log" && ! grep -q "has not completed" "$WORK/mid.log" || { cat "$WORK/mid.log"; fail "disk full mid-write: no message"; }
  echo "ok: disk full mid-write: job ended (exit $rc): $(grep -m1 -o 'error \[rank [0-9]/2\]: .\{0,90\}' "$WORK/mid.log")"
  [ "$(cat "$WORK/small/ck/latest")" = "step_00000002.h5" ] || fail "disk_full: latest moved"
  [ "$(sha256sum "$WORK/small/ck/step_00000002.h5")" = "$sum" ] || fail "disk_full: the published checkpoint changed"
  echo "ok: full disk (refused up front, and failing mid-write): latest still names step 2, its bytes unchanged"
else
  echo "skip: disk_full (cannot mount a tmpfs here; needs root)"
fi

head -c 74 "$DATA" >"$WORK/tiny.tok"  # header + 5 tokens; fix the header: 4 train + 1 val, no metadata (J = 0)
"$PY" - "$WORK/tiny.tok" <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[8:12] = (1).to_bytes(4, "little"); b[28:32] = (0).to_bytes(4, "little")  # version 1: no metadata
b[32:40] = (4).to_bytes(8, "little"); b[40:48] = (1).to_bytes(8, "little")
open(sys.argv[1], "wb").write(b)
PY
expect_fail short_corpus "the train split of the token file holds 4 tokens, fewer than one sequence of --seq-len + 1 = 17" 2 \
  --model tiny --data "$WORK/tiny.tok" --seq-len 16 --global-batch 4 --threads 1
expect_fail missing_corpus "cannot read input text '$WORK/none.txt' (option '--input')" 1 --mode prepare --input "$WORK/none.txt" --out "$WORK/x.tok"
