#!/usr/bin/env bash
# A refactor's bitwise check against an earlier build: tests/bench/bitwise_ab.sh REF_BIN NEW_BIN [OUT]
# Runs the same tiny trainings (12 steps, checkpoints at steps 6 and 12) with both binaries in 9
# configurations (fp32 W=2; fp32 W=3 --overlap off; bf16 W=2; bf16 W=3 with bf16 reduce; hybrid
# sharding W=4 G=2; --comm-progress thread W=2; wait W=3 prefetch 2; TP 2 x FSDP 2 W=4; TP 2 with
# hybrid sharding W=8 G=4) and compares, exactly: every
# loss and validation loss of the metrics files, and every dataset and attribute of every
# checkpoint (h5py; HDF5's own object timestamps are not visible to it). NEW_ARGS="..." passes
# options to NEW_BIN only (e.g. --checkpoint-async off). Exit 0 when everything is equal.
# Needs build/data/fortunes.tok (make data) and .venv (make venv). Not part of make test: REF_BIN
# is whatever build the change is measured against (e.g. fc357bb's for the mesh refactor).
set -u
REF=$1 NEW=$2 OUT=${3:-build/bitwise-ab}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
DATA=$ROOT/build/data/fortunes.tok
PY=$ROOT/.venv/bin/python
mkdir -p "$OUT"
fail=0
run() {  # name np args...
  local name=$1 np=$2; shift 2
  for which in ref new; do
    local bin=$REF extra=()
    if [ $which = new ]; then bin=$NEW; read -r -a extra <<<"${NEW_ARGS:-}"; fi
    rm -rf "$OUT/$name-$which"; mkdir -p "$OUT/$name-$which"
    timeout 600 mpirun --oversubscribe -np "$np" "$bin" --model demo --data "$DATA" --seq-len 32 --global-batch 12 \
      --steps 12 --log-every 1 --eval-every 6 --eval-batches 2 --seed 7 --threads 1 \
      --metrics "$OUT/$name-$which/m.jsonl" --checkpoint-dir "$OUT/$name-$which/ck" --checkpoint-every 6 "$@" \
      "${extra[@]}" >"$OUT/$name-$which/log" 2>&1 \
      || { echo "$name $which: exit $?"; tail -5 "$OUT/$name-$which/log"; fail=1; }
  done
  "$PY" - "$OUT/$name-ref" "$OUT/$name-new" "$name" <<'PY' || fail=1
import json, os, sys
import h5py
a, b, name = sys.argv[1:]
def losses(d):
    return [(r.get("step"), r.get("loss"), r.get("val_loss")) for r in map(json.loads, open(d + "/m.jsonl"))
            if "loss" in r or "val_loss" in r]
la, lb = losses(a), losses(b)
diffs, n = [], [0]
def walk(g, h, path):
    for k in g:
        if isinstance(g[k], h5py.Dataset):
            n[0] += 1
            if k not in h or g[k][()].tobytes() != h[k][()].tobytes(): diffs.append(path + k)
        else: walk(g[k], h[k], path + k + "/")
    for k in g.attrs:
        if k not in h.attrs or str(g.attrs[k]) != str(h.attrs[k]): diffs.append(path + "@" + k)
files = sorted(f for f in os.listdir(a + "/ck") if f.endswith(".h5"))
for f in files:
    walk(h5py.File(a + "/ck/" + f), h5py.File(b + "/ck/" + f), f + ":/")
ok = la == lb and len(la) > 0 and not diffs and len(files) > 0
print(f"{name}: losses {'identical' if la == lb else 'DIFFER'} ({len(la)} rows); {len(files)} checkpoints, "
      f"{n[0]} datasets; entries differing: {sorted(set(diffs)) or 'none'}")
sys.exit(0 if ok else 1)
PY
}
run fp32-w2 2
run fp32-w3-nooverlap 3 --overlap off
run bf16-w2 2 --precision bf16
run bf16-w3-rbf16 3 --precision bf16 --reduce-dtype bf16
run hsdp-w4 4 --shard-group-size 2
run thread-w2 2 --comm-progress thread
run wait-w3 3 --comm-progress wait --prefetch 2
# Tensor parallelism: TP 2 x FSDP 2, and TP 2 under hybrid sharding (shard groups of 2 x TP 2, 2 replicas).
run tp2-fsdp2-w4 4 --tp 2
run tp2-hsdp-w8 8 --tp 2 --shard-group-size 4
exit $fail
