#!/usr/bin/env bash
# Trust what is loaded (issue 11, items 1 and 2).
#  * Every attribute and table a load uses is covered by the metadata checksums: one byte changed in
#    each kind (root and unit attributes, strings and integers, the shard, CRC32 and parameter tables,
#    the checksum table itself) is refused by --mode inspect, naming the file and the attribute; the
#    issue's example (rope_theta 10000.0 -> 90000.0, edited in place) is refused on every read path:
#    resume, --init-from, export, generate, inspect.
#  * ckpt_meta.py (h5py alone, from the documented layout) verifies every checkpoint shardtrain
#    writes; redundant fields made inconsistent (and resealed, so the checksums pass) are refused by
#    the cross-checks; a version 1 file (no checksums) still loads, with a note.
#  * Ranks that read different files under one path (an MPMD launch with another working directory
#    on ranks 1-2, holding an older checkpoint under the newer name, or a truncated copy) all stop
#    with one message naming ranks 1-2, instead of resuming different states; likewise a checkpoint
#    directory or a token file that is not the same on every rank, before training starts.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
META=$ROOT/tests/e2e/ckpt_meta.py
ARGS=(--model tiny --data "$DATA" --seq-len 16 --global-batch 6 --steps 8 --eval-every 0 --eval-batches 1 --threads 1)
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --checkpoint-dir "$WORK/ck" --checkpoint-every 3 --stop-at-step 6 \
  >"$WORK/make.log" 2>&1 || { cat "$WORK/make.log"; fail "making the checkpoints"; }
GOOD=$WORK/ck/step_00000006.h5
for f in "$WORK"/ck/step_*.h5; do "$PY" "$META" verify "$f" >/dev/null || fail "ckpt_meta.py does not verify $f"; done
echo "ok: h5py alone (ckpt_meta.py) verifies the metadata checksums of both checkpoints shardtrain wrote"

# Variants: one byte changed in one item each. Strings are edited in place in the file's bytes (the
# value is found in the global heap); integers and tables through h5py, with one byte XOR-ed.
"$PY" - "$GOOD" "$WORK" <<'PY'
import json, shutil, sys
import h5py, numpy as np
good, work = sys.argv[1], sys.argv[2]
raw = open(good, "rb").read()
cases = []

def variant(name, want, edit):
    path = f"{work}/v_{name}.h5"
    shutil.copy(good, path)
    edit(path)
    cases.append((name, path, want))

def in_place(old, new):
    def edit(path):
        assert raw.count(old) == 1, (old, raw.count(old))
        b = bytearray(raw)
        i = raw.index(old)
        b[i:i + len(old)] = new
        open(path, "wb").write(bytes(b))
    return edit

def flip_string(attr):  # one byte in the middle of a string attribute's value, in place
    with h5py.File(good, "r") as f:
        v = f.attrs[attr].encode()
    i = len(v) // 2
    return in_place(v, v[:i] + bytes([v[i] ^ 0x01]) + v[i + 1:])

def flip_int(obj, attr, byte=0, value=None):  # XOR one byte, or set a value that differs in one byte
    def edit(path):
        with h5py.File(path, "r+") as f:
            o = f[obj]
            o.attrs.modify(attr, np.int64(value if value is not None else int(o.attrs[attr]) ^ (1 << (8 * byte))))
    return edit

def flip_table(ds, index):
    def edit(path):
        with h5py.File(path, "r+") as f:
            t = f[ds][:]
            if t.dtype.names:  # param_table: one byte of a row's offset
                t[index]["offset"] ^= 1
            else:
                t.flat[index] ^= 1
            f[ds][...] = t
    return edit

variant("rope_theta", "attribute 'model_config' fails its CRC32 check", in_place(b'"rope_theta":10000.0', b'"rope_theta":90000.0'))
for a in ["train_config", "data_position", "rng_state", "program_version", "data", "spike_stats"]:
    variant(a, f"attribute '{a}' fails its CRC32 check", flip_string(a))
variant("format", "attribute 'format' is", flip_string("format"))
variant("table", "attribute 'metadata_crc32' (the metadata checksums) fails its own CRC32 check", flip_string("metadata_crc32"))
variant("table_check", "fails its own CRC32 check ('metadata_crc32_check')", flip_int("/", "metadata_crc32_check", 1))
for a in ["step", "tokens_seen", "world_size"]:
    variant(a, f"attribute '{a}' fails its CRC32 check", flip_int("/", a))
variant("format_version", "unknown format version 259 in attribute 'format_version'", flip_int("/", "format_version", 1))
variant("format_version_1", "attribute 'format_version' says 1, but the file carries the metadata checksums", flip_int("/", "format_version", value=1))
for a in ["index", "numel", "shard_size", "padded_numel"]:
    variant("unit_" + a, f"attribute '{a}' of unit 'model.layers.1' fails its CRC32 check", flip_int("units/model.layers.1", a))
def to_array(obj, attr, n):  # the same value, as an array of n (an attribute must be one value)
    def edit(path):
        with h5py.File(path, "r+") as f:
            v = f[obj].attrs[attr]
            del f[obj].attrs[attr]
            f[obj].attrs[attr] = [v] * n
    return edit

variant("step_array", "attribute 'step' is not a single value", to_array("/", "step", 7000))
variant("format_array", "attribute 'format' is not a single value", to_array("/", "format", 2))
variant("numel_array", "attribute 'numel' is not a single value", to_array("units/model.norm", "numel", 2))
for ds, i in [("shard_table", 4), ("shard_crc32", 3), ("param_table", 1)]:
    variant(ds, f"dataset 'units/model.layers.0/{ds}' fails its CRC32 check", flip_table(f"units/model.layers.0/{ds}", i))
with open(f"{work}/cases.txt", "w") as out:
    for name, path, want in cases:
        print(f"{name}\t{path}\t{want}", file=out)
print(f"ok: made {len(cases)} variants, one changed item each")
PY
n=0
while IFS=$'\t' read -r name path want; do
  rc=0
  timeout -k 5 60 "$BIN" --mode inspect "$path" >"$WORK/inspect_$name.log" 2>&1 || rc=$?
  [ "$rc" = 1 ] || { cat "$WORK/inspect_$name.log"; fail "$name: inspect exit status $rc, expected 1"; }
  grep -qF -- "checkpoint '$path': " "$WORK/inspect_$name.log" || { cat "$WORK/inspect_$name.log"; fail "$name: the file is not named"; }
  grep -qF -- "$want" "$WORK/inspect_$name.log" || { cat "$WORK/inspect_$name.log"; fail "$name: message lacks '$want'"; }
  n=$((n + 1))
done <"$WORK/cases.txt"
echo "ok: inspect refuses all $n variants, naming the file and the changed attribute or table"

# The issue's example on every read path, at 2 ranks.
R=$WORK/v_rope_theta.h5
WANT="checkpoint '$R': attribute 'model_config' fails its CRC32 check"
expect_fail theta_resume "$WANT" 2 "${ARGS[@]}" --resume "$R"
expect_fail theta_init_from "$WANT" 2 "${ARGS[@]}" --init-from "$R"
expect_fail theta_export "$WANT" 2 --mode export "$R" --out "$WORK/hf"
expect_fail theta_generate "$WANT" 2 --mode generate "$R" --max-new-tokens 2
expect_fail theta_inspect "$WANT" 2 --mode inspect "$R"
[ ! -e "$WORK/hf/config.json" ] || fail "export wrote a config.json from an edited checkpoint"

# Cross-checks of the redundant fields: consistent checksums (resealed), inconsistent values.
cross() {  # name want python-edit
  cp "$GOOD" "$WORK/x_$1.h5"
  "$PY" -c "import h5py, json, sys; f = h5py.File(sys.argv[1], 'r+'); $3" "$WORK/x_$1.h5"
  "$PY" "$META" reseal "$WORK/x_$1.h5"
  expect_fail "cross_$1" "$2" 2 --mode inspect "$WORK/x_$1.h5"
}
cross tokens "attribute 'tokens_seen' is 999, but 6 steps of the batch history in attribute 'data_position' consume 576 tokens" \
  "f.attrs['tokens_seen'] = 999"
cross position "attribute 'data_position' says next_batch_index 5, but attribute 'step' is 6" \
  "d = json.loads(f.attrs['data_position']); d['next_batch_index'] = 5; f.attrs['data_position'] = json.dumps(d)"
cross seed "attribute 'train_config' has seed 7, attribute 'rng_state' has 1337" \
  "d = json.loads(f.attrs['train_config']); d['seed'] = 7; f.attrs['train_config'] = json.dumps(d)"
cross shard_table "row 1 of dataset 'shard_table' is" \
  "t = f['units/model.norm/shard_table'][:]; t[1] = [0, 32, 0]; f['units/model.norm/shard_table'][...] = t"
cross world "are inconsistent with world_size (3)" "f.attrs['world_size'] = 3"
cross spike_stats "attribute 'spike_stats' is malformed: 'loss' and 'grad_norm' hold 5 and 6 values for a window of 128" \
  "d = json.loads(f.attrs['spike_stats']); d['loss'].pop(); f.attrs['spike_stats'] = json.dumps(d)"
cross no_lr "attribute 'train_config' has no 'lr'" \
  "d = json.loads(f.attrs['train_config']); del d['lr']; f.attrs['train_config'] = json.dumps(d)"
cross lr_string "attribute 'train_config': 'lr' is not a number" \
  "d = json.loads(f.attrs['train_config']); d['lr'] = 'x'; f.attrs['train_config'] = json.dumps(d)"
cross dup_row "tensor 'model.layers.0.mlp.down_proj.weight' appears twice in 'param_table'" \
  "g = f['units/model.layers.0']; t = g['param_table'][:]; import numpy as np; t2 = np.concatenate([t, t[-1:]]); del g['param_table']; g['param_table'] = t2"

# A version 1 file (before the checksums): loads, with a note; its tensor data is still verified.
V1=$WORK/v1.h5
cp "$GOOD" "$V1"
"$PY" - "$V1" <<'PY'
import h5py, json, sys
with h5py.File(sys.argv[1], "r+") as f:
    for a in ["metadata_crc32", "metadata_crc32_check", "data"]:
        del f.attrs[a]
    f.attrs["format_version"] = 1
    d = json.loads(f.attrs["data_position"]); del d["segments"]; f.attrs["data_position"] = json.dumps(d)
PY
timeout -k 5 60 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --resume "$V1" --stop-at-step 7 --metrics "$WORK/v1.jsonl" \
  >"$WORK/v1.log" 2>&1 || { cat "$WORK/v1.log"; fail "a version 1 checkpoint does not resume"; }
grep -q "is format version 1: its attributes carry no checksums" "$WORK/v1.log" || fail "no note for a version 1 file"
echo "ok: a version 1 checkpoint (no metadata checksums) resumes, with a note"

# Ranks that read different files under one path. Rank 0 runs in A, ranks 1-2 in B; the same
# relative path names the newest checkpoint in A and an older one (or a truncated copy) in B.
mpmd() {  # name: runs --resume ck/step_00000006.h5 with rank 0 in $WORK/A, ranks 1-2 in $WORK/B
  local rc=0
  timeout -k 5 60 mpirun --oversubscribe -np 1 --wdir "$WORK/A" "$BIN" "${ARGS[@]}" --resume ck/step_00000006.h5 : \
    -np 2 --wdir "$WORK/B" "$BIN" "${ARGS[@]}" --resume ck/step_00000006.h5 >"$WORK/$1.log" 2>&1 || rc=$?
  [ "$rc" != 0 ] && [ "$rc" != 124 ] || { cat "$WORK/$1.log"; fail "$1: exit status $rc"; }
  for r in 0 1 2; do grep -q "error \[rank $r/3\]" "$WORK/$1.log" || { cat "$WORK/$1.log"; fail "$1: rank $r did not report"; }; done
}
mkdir -p "$WORK/A/ck" "$WORK/B/ck"
cp "$GOOD" "$WORK/A/ck/step_00000006.h5"
cp "$WORK/ck/step_00000003.h5" "$WORK/B/ck/step_00000006.h5"  # a stale copy under the newer name
mpmd stale
grep -q "has different contents on different ranks (rank 0 read step 6, ranks 1-2 read step 3" "$WORK/stale.log" \
  || { cat "$WORK/stale.log"; fail "stale copy: message does not name the ranks and steps"; }
echo "ok: a stale copy on ranks 1-2 -> $(grep -m1 'error \[rank 0' "$WORK/stale.log" | cut -c1-220)"
head -c $(($(stat -c %s "$GOOD") * 2 / 3)) "$GOOD" >"$WORK/B/ck/step_00000006.h5"  # a partial copy
mpmd truncated
grep -q "is not the same file on every rank (.*): it is truncated or damaged on ranks 1-2" "$WORK/truncated.log" \
  || { cat "$WORK/truncated.log"; fail "truncated copy: message does not say it is truncated on ranks 1-2"; }
grep -q "is missing from unit" "$WORK/truncated.log" && fail "truncated copy: misleading 'missing' message"
echo "ok: a truncated copy on ranks 1-2 -> $(grep -m1 'error \[rank 0' "$WORK/truncated.log" | cut -c1-220)"

# The other files every rank uses itself: the checkpoint directory (a save of ranks that see
# different directories would hang in the collective write) and the token file.
mpmd_args() {  # name args...: rank 0 in $WORK/A, ranks 1-2 in $WORK/B, the same relative arguments
  local name=$1 rc=0
  shift
  timeout -k 5 60 mpirun --oversubscribe -np 1 --wdir "$WORK/A" "$BIN" "$@" : -np 2 --wdir "$WORK/B" "$BIN" "$@" \
    >"$WORK/$name.log" 2>&1 || rc=$?
  [ "$rc" != 0 ] && [ "$rc" != 124 ] || { cat "$WORK/$name.log"; fail "$name: exit status $rc"; }
  for r in 0 1 2; do grep -q "error \[rank $r/3\]" "$WORK/$name.log" || { cat "$WORK/$name.log"; fail "$name: rank $r did not report"; }; done
}
T=(--model tiny --seq-len 16 --global-batch 6 --steps 4 --eval-every 0 --eval-batches 1 --threads 1)
mpmd_args local_dir "${T[@]}" --data "$DATA" --checkpoint-dir ck_local
grep -q "checkpoint directory 'ck_local' (option '--checkpoint-dir') is not the same directory on every rank: ranks 1-2 cannot see" \
  "$WORK/local_dir.log" || { cat "$WORK/local_dir.log"; fail "local_dir: message"; }
grep -q "^step 1/" "$WORK/local_dir.log" && fail "local_dir: trained before finding out the directory is not shared"
cp "$DATA" "$WORK/A/c.tok"
"$BIN" --mode prepare --input /usr/share/games/fortunes/riddles --out "$WORK/B/c.tok" >/dev/null
mpmd_args other_data "${T[@]}" --data c.tok
grep -q "token file 'c.tok' (options '--data', '--val-data') is not the same on every rank: ranks 1-2 read other contents than rank 0" \
  "$WORK/other_data.log" || { cat "$WORK/other_data.log"; fail "other_data: message"; }
echo "ok: a checkpoint directory or a token file that differs between ranks is refused before training, naming ranks 1-2"
