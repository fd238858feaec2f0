#!/usr/bin/env bash
# Token data as people keep it (docs/data-format.md): the tokens of the test corpus written with
# numpy as llm.c .bin shards (one file, and two shards read through a glob), and as nanoGPT raw
# uint16 train.bin / val.bin, must train exactly like the same tokens in one shardtrain file (same
# seed -> same batches -> the same losses, to the last bit, at 2 ranks). Bad files are refused on
# every rank, naming the file.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
"$PY" - "$DATA" "$WORK" <<'PY'
import numpy as np, sys
src, work = sys.argv[1], sys.argv[2]
h = np.fromfile(src, dtype="<u8", count=8)
n_train, n_val = int(h[4]), int(h[5])
assert int(np.fromfile(src, dtype="<u4", count=7)[6]) == 2
tok = np.fromfile(src, dtype="<u2", count=n_train + n_val, offset=64)
train, val = tok[:n_train], tok[n_train:]
def llmc(path, toks, magic=20240520, version=1, count=None, dtype=np.uint16):
    # llm.c dev/data/data_common.py write_datafile: 256 int32, [0] magic, [1] version, [2] tokens
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(toks) if count is None else count
    with open(path, "wb") as f:
        header.tofile(f)
        np.asarray(toks, dtype=dtype).tofile(f)
llmc(f"{work}/all_train.bin", train)
cut = n_train // 3
llmc(f"{work}/shard_000.bin", train[:cut])
llmc(f"{work}/shard_001.bin", train[cut:])
llmc(f"{work}/val_000.bin", val)
train.astype("<u2").tofile(f"{work}/train.bin")   # nanoGPT: raw uint16, no header
val.astype("<u2").tofile(f"{work}/val.bin")
llmc(f"{work}/badmagic.bin", train, magic=12345)
llmc(f"{work}/badcount.bin", train, count=n_train + 10)
big = train.astype(np.uint16).copy(); big[1000] = 50000   # a GPT-2-sized id for a byte-level model
llmc(f"{work}/bigid.bin", big)
print(f"wrote llm.c and nanoGPT files: {n_train} train + {n_val} val tokens (shard cut at {cut})")
PY

COMMON=(--model tiny --seq-len 32 --global-batch 4 --steps 3 --lr 3e-3 --log-every 1 --eval-every 0 --eval-batches 1 --threads 1)
run() {  # run NAME DATA-OPTIONS...
  local name=$1
  shift
  timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${COMMON[@]}" "$@" --metrics "$WORK/$name.jsonl" >"$WORK/$name.log" 2>&1 \
    || { cat "$WORK/$name.log"; fail "$name: training failed"; }
  losses "$WORK/$name.jsonl" >"$WORK/$name.loss"
  [ "$(wc -l <"$WORK/$name.loss")" -eq 3 ] || fail "$name: expected 3 losses"
  grep -o '"val_loss": *[0-9.e+-]*' "$WORK/$name.jsonl" | tail -1 >>"$WORK/$name.loss"
}
run shardtrain --data "$DATA"
run llmc --data "$WORK/all_train.bin" --val-data "$WORK/val_000.bin"
grep -q "llm.c gpt-2 (u16), no vocabulary" "$WORK/llmc.log" || { cat "$WORK/llmc.log"; fail "llmc: format not reported"; }
run llmc_glob --data "$WORK/shard_*.bin" --val-data "$WORK/val_*.bin"
grep -q "token files '$WORK/shard_000.bin' and 2 more" "$WORK/llmc_glob.log" || { cat "$WORK/llmc_glob.log"; fail "llmc_glob: not 2 shards + 1 val file"; }
run nanogpt --data "$WORK/train.bin" --val-data "$WORK/val.bin" --data-format nanogpt
# A job file: repeated keys give several files, in order (the two shards of the glob).
printf 'data = %s\ndata = %s\nval-data = %s\n' "$WORK/shard_000.bin" "$WORK/shard_001.bin" "$WORK/val_000.bin" >"$WORK/job.ini"
run llmc_job --config "$WORK/job.ini"
for r in llmc llmc_glob nanogpt llmc_job; do
  cmp -s "$WORK/shardtrain.loss" "$WORK/$r.loss" || { paste "$WORK/shardtrain.loss" "$WORK/$r.loss"; fail "$r: losses differ from the shardtrain file's"; }
done
echo "ok: shardtrain, llm.c (1 file), llm.c (glob of 2 shards), llm.c (job file, 2 data keys), nanoGPT: identical losses $(paste -sd' ' "$WORK/shardtrain.loss")"

# Exact resume over several files: stop after step 2, resume at another world size; the step-3
# loss is the uninterrupted run's, and the checkpoint records every file and the dataset's CRC32.
GLOB=(--data "$WORK/shard_*.bin" --val-data "$WORK/val_*.bin")
timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${COMMON[@]}" "${GLOB[@]}" --checkpoint-dir "$WORK/ck" --stop-at-step 2 \
  --metrics "$WORK/res.jsonl" >"$WORK/res1.log" 2>&1 || { cat "$WORK/res1.log"; fail "resume: first part failed"; }
timeout -k 5 120 $MPIRUN -np 1 "$BIN" "${COMMON[@]}" "${GLOB[@]}" --checkpoint-dir "$WORK/ck" --resume auto \
  --metrics "$WORK/res.jsonl" >"$WORK/res2.log" 2>&1 || { cat "$WORK/res2.log"; fail "resume: second part failed"; }
losses "$WORK/res.jsonl" >"$WORK/res.loss"
"$PY" - "$WORK" "$(sed -n 3p "$WORK/llmc_glob.loss")" "$(tail -1 "$WORK/res.loss")" <<'PY'
import glob, h5py, json, sys, zlib
work, want, got = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
assert abs(got - want) <= 1e-6 * abs(want), f"resumed step-3 loss {got} vs uninterrupted {want}"
ck = sorted(glob.glob(f"{work}/ck/step_*.h5"))[-1]
d = json.loads(h5py.File(ck, "r").attrs["data"])
files = [f"{work}/shard_000.bin", f"{work}/shard_001.bin", f"{work}/val_000.bin"]
assert d["files"] == files and d["path"] == files[0], d
crcs = b"".join((zlib.crc32(open(f, "rb").read())).to_bytes(4, "little") for f in files)
assert d["crc32"] == zlib.crc32(crcs), (d["crc32"], zlib.crc32(crcs))
assert d["vocab_size"] == 0 and d["formats"] == ["llm.c gpt-2 (u16)"] * 3, d
print(f"ok: resume over 2 shards (W=2 -> 1): step-3 loss {got} = uninterrupted {want}; checkpoint records {len(files)} files, CRC32 of their CRC32s")
PY

expect_fail llmc_bad_magic "token file '$WORK/badmagic.bin': bad magic" 2 "${COMMON[@]}" --data "$WORK/badmagic.bin" --val-data "$WORK/val_000.bin"
expect_fail raw_without_flag "token file '$WORK/train.bin': bad magic: neither a shardtrain token file" 2 "${COMMON[@]}" --data "$WORK/train.bin" --val-data "$WORK/val.bin"
grep -qF -- "'--data-format nanogpt'" "$WORK/raw_without_flag.log" || fail "raw_without_flag: no hint"
expect_fail llmc_count_beyond_size "token file '$WORK/badcount.bin': llm.c header token count" 2 "${COMMON[@]}" --data "$WORK/badcount.bin" --val-data "$WORK/val_000.bin"
expect_fail llmc_as_shardtrain "token file '$WORK/all_train.bin': bad magic (not a shardtrain token file)" 2 "${COMMON[@]}" --data "$WORK/all_train.bin" --val-data "$WORK/val_000.bin" --data-format shardtrain
expect_fail id_beyond_model_vocab "token id 50000 at token file '$WORK/bigid.bin' byte offset 3024 is >= the model's vocab_size (258)" 2 "${COMMON[@]}" --data "$WORK/bigid.bin" --val-data "$WORK/val_000.bin"
expect_fail no_val_stream "name validation files with option '--val-data'" 2 "${COMMON[@]}" --data "$WORK/all_train.bin"
expect_fail glob_no_match "option '--data': pattern '$WORK/nothing_*.bin' matches no file" 2 "${COMMON[@]}" --data "$WORK/nothing_*.bin"
