#!/usr/bin/env bash
# Damaged or mismatched checkpoints: every rank exits non-zero with the same message naming the
# file and the unit/tensor, well inside a timeout; nothing hangs.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
ARGS=(--model tiny --data "$DATA" --seq-len 16 --global-batch 6 --steps 4 --eval-every 0 --eval-batches 1 --threads 1)
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --checkpoint-dir "$WORK/ck" --stop-at-step 2 >"$WORK/make.log" 2>&1 \
  || { cat "$WORK/make.log"; fail "making the checkpoint"; }
GOOD=$WORK/ck/step_00000002.h5
variant() { cp "$GOOD" "$WORK/$1.h5"; echo "$WORK/$1.h5"; }
# flip FILE: four bytes in the middle of dataset units/model.layers.1/adam_v flipped (its CRC32 fails).
flip() {
  "$PY" - "$1" <<'PY'
import sys, h5py
path = sys.argv[1]
with h5py.File(path, "r") as f:
    d = f["units/model.layers.1/adam_v"]
    off = d.id.get_offset() + 4 * (d.shape[0] // 2)
with open(path, "r+b") as fh:
    fh.seek(off); b = bytearray(fh.read(4)); fh.seek(off); fh.write(bytes(x ^ 0x5A for x in b))
PY
}

T=$(variant truncated); truncate -s $(($(stat -c %s "$GOOD") / 2)) "$T"
expect_fail truncated "checkpoint '$T'" 3 "${ARGS[@]}" --resume "$T"
grep -q "truncated\|damaged\|cannot open" "$WORK/truncated.log" || fail "truncated: message does not say the file is damaged"

F=$(variant flipped)
flip "$F"
expect_fail flipped_bytes "dataset 'units/model.layers.1/adam_v'" 3 "${ARGS[@]}" --resume "$F"
grep -q "fails its CRC32 check" "$WORK/flipped_bytes.log" || fail "flipped bytes: no CRC32 message"

# '--resume auto' whose newest checkpoint is damaged names the one before it (step 2 of a run that
# saved steps 2 and 4, step 4's bytes flipped as above).
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --checkpoint-dir "$WORK/ck2" --checkpoint-every 2 >"$WORK/ck2.log" 2>&1 \
  || { cat "$WORK/ck2.log"; fail "making checkpoints 2 and 4"; }
flip "$WORK/ck2/step_00000004.h5"
expect_fail damaged_latest "the checkpoint before it is '$WORK/ck2/step_00000002.h5': pass it to '--resume' to continue from there ('latest' still names the unreadable one)" 2 "${ARGS[@]}" --checkpoint-dir "$WORK/ck2" --resume auto
grep -q "fails its CRC32 check" "$WORK/damaged_latest.log" || fail "damaged latest: no CRC32 message"
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --checkpoint-dir "$WORK/ck2" --resume "$WORK/ck2/step_00000002.h5" \
  >"$WORK/ck2b.log" 2>&1 || { cat "$WORK/ck2b.log"; fail "resuming from the checkpoint the message named"; }
grep -q "resumed from '$WORK/ck2/step_00000002.h5' at step 2" "$WORK/ck2b.log" || { cat "$WORK/ck2b.log"; fail "not resumed at step 2"; }
echo "ok: a damaged newest checkpoint under '--resume auto' names the one before it, which resumes"

V=$(variant version); "$PY" -c 'import h5py,sys; f=h5py.File(sys.argv[1],"r+"); f.attrs["format_version"]=99' "$V"
expect_fail wrong_version "checkpoint '$V': unknown format version 99 in attribute 'format_version' (this program reads versions 1 to 7)" 3 "${ARGS[@]}" --resume "$V"

U=$(variant unit); "$PY" -c 'import h5py,sys; f=h5py.File(sys.argv[1],"r+"); del f["units/model.layers.1"]' "$U"
expect_fail deleted_unit "checkpoint '$U': the metadata checksum table names dataset 'units/model.layers.1/param_table', which the file lacks" 3 "${ARGS[@]}" --resume "$U"
"$PY" -c 'import h5py,sys; f=h5py.File(sys.argv[1],"r+"); f["units/model.norm"].attrs["index"]=2' "$U"
"$PY" "$ROOT/tests/e2e/ckpt_meta.py" reseal "$U"  # a consistent file of a model without that layer
expect_fail missing_unit "checkpoint '$U': missing unit 'model.layers.1'" 3 "${ARGS[@]}" --resume "$U"

S=$(variant shape)
"$PY" - "$S" <<'PY'
import sys, h5py
f = h5py.File(sys.argv[1], "r+")
t = f["units/model.layers.0/param_table"][:]
i = [r["name"].decode() for r in t].index("model.layers.0.mlp.up_proj.weight")
t[i]["shape"][0] += 1
f["units/model.layers.0/param_table"][...] = t
PY
"$PY" "$ROOT/tests/e2e/ckpt_meta.py" reseal "$S"  # a consistent file of another shape, not a damaged one
expect_fail wrong_shape "tensor 'model.layers.0.mlp.up_proj.weight' has shape [65, 32] in the file, expected [64, 32]" 3 "${ARGS[@]}" --resume "$S"

expect_fail config_mismatch "checkpoint '$GOOD': model config does not match the requested one (" 3 \
  --model test-uneven --data "$DATA" --seq-len 16 --global-batch 6 --steps 4 --threads 1 --resume "$GOOD"
grep -q "hidden_size: checkpoint has 32, requested 50" "$WORK/config_mismatch.log" || fail "config mismatch: no key named"

printf 'not hdf5\n' >"$WORK/text.h5"
expect_fail not_hdf5 "checkpoint '$WORK/text.h5': not an HDF5 file" 3 "${ARGS[@]}" --resume "$WORK/text.h5"
expect_fail missing_file "checkpoint '$WORK/none.h5' (option '--resume'): no such file" 3 "${ARGS[@]}" --resume "$WORK/none.h5"
expect_fail inspect_missing "checkpoint '$WORK/none.h5': no such file" 2 --mode inspect "$WORK/none.h5"
chmod 500 "$WORK/ck"
if [ "$(id -u)" -ne 0 ]; then  # root ignores directory permissions
  expect_fail unwritable_dir "is not writable" 2 "${ARGS[@]}" --checkpoint-dir "$WORK/ck"
fi
chmod 700 "$WORK/ck"
: >"$WORK/afile"
expect_fail dir_is_file "cannot create checkpoint directory '$WORK/afile/sub'" 2 "${ARGS[@]}" --checkpoint-dir "$WORK/afile/sub"
expect_fail fresh_run_into_used_dir "already holds checkpoints (step_00000002.h5, ...): pass '--resume auto'" 2 \
  "${ARGS[@]}" --checkpoint-dir "$WORK/ck"
# One training run per checkpoint directory: a run's rank 0 holds flock(2) on '.shardtrain.lock'
# there for its lifetime; a second run (here the lock held by flock(1)) is refused on every rank.
[ -f "$WORK/ck/.shardtrain.lock" ] || fail "no lock file in the checkpoint directory of an earlier run"
flock "$WORK/ck/.shardtrain.lock" sleep 120 &
holder=$!
for _ in $(seq 100); do flock -n "$WORK/ck/.shardtrain.lock" true || break; sleep 0.1; done
expect_fail dir_in_use "checkpoint directory '$WORK/ck' is in use by another training run (host " 2 \
  "${ARGS[@]}" --checkpoint-dir "$WORK/ck" --resume auto
kill "$holder"
wait "$holder" 2>/dev/null || true
# The lock file is opened without following a symbolic link, and must be a file of its own: a link
# planted there must not make a (root) run truncate and write the file it names.
mkdir -p "$WORK/lk_sym" "$WORK/lk_hard"
echo "precious" >"$WORK/victim"
ln -s "$WORK/victim" "$WORK/lk_sym/.shardtrain.lock"
expect_fail lock_symlink "'$WORK/lk_sym/.shardtrain.lock': it is a symbolic link" 2 "${ARGS[@]}" --checkpoint-dir "$WORK/lk_sym"
ln "$WORK/victim" "$WORK/lk_hard/.shardtrain.lock"
expect_fail lock_hardlink "'$WORK/lk_hard/.shardtrain.lock' is not a regular file of its own" 2 "${ARGS[@]}" \
  --checkpoint-dir "$WORK/lk_hard"
[ "$(cat "$WORK/victim")" = "precious" ] || fail "the file a planted lock link names was written: '$(cat "$WORK/victim")'"
# The good checkpoint is untouched by all of the above and still loads.
timeout -k 5 60 $MPIRUN -np 3 "$BIN" "${ARGS[@]}" --resume "$GOOD" >"$WORK/ok.log" 2>&1 || { cat "$WORK/ok.log"; fail "good checkpoint no longer loads"; }
echo "ok: the original checkpoint still loads at 3 ranks"
