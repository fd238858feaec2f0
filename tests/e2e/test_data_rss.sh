#!/usr/bin/env bash
# A token set larger than the heap costs pages, not resident memory: a 1.1 GiB shardtrain token
# file (a sparse file: header + truncate; its zero tokens are valid ids) is validated with pread()
# in fixed chunks and memory-mapped, so training a tiny model on it keeps every rank's peak
# resident memory (VmHWM) far below the file's size.
source "$(dirname "$0")/common.sh"
F=$WORK/big.tok
N_TRAIN=$((550 * 1024 * 1024))  # u16 tokens: 1.1 GiB
N_VAL=$((1024 * 1024))
"$PY" - "$F" "$N_TRAIN" "$N_VAL" <<'PY'
import struct, sys
path, n_train, n_val = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
h = b"STTOKv1\0" + struct.pack("<6I", 1, 258, 256, 257, 2, 0) + struct.pack("<2Q", n_train, n_val)
h += b"byte-level".ljust(16, b"\0")
with open(path, "wb") as f:
    f.write(h)
    f.truncate(64 + 2 * (n_train + n_val))
PY
size=$(stat -c %s "$F")
[ "$size" -gt $((1 << 30)) ] || fail "file is only $size bytes"
timeout -k 5 120 $MPIRUN -np 2 "$BIN" --model tiny --data "$F" --seq-len 32 --global-batch 4 --steps 2 --eval-batches 1 \
  --threads 1 >"$WORK/rss.log" 2>&1 || { cat "$WORK/rss.log"; fail "training on the large file failed"; }
line=$(grep -o 'memory: peak resident (VmHWM) per rank [0-9, ]* MiB' "$WORK/rss.log") || { cat "$WORK/rss.log"; fail "no VmHWM line"; }
max=$(echo "$line" | grep -oE '[0-9]+' | sort -n | tail -1)
[ "$max" -lt 400 ] || { cat "$WORK/rss.log"; fail "peak resident memory $max MiB per rank for a $((size >> 20)) MiB token file"; }
echo "ok: $((size >> 20)) MiB token file, 2 ranks: ${line#memory: }"
