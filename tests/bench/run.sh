#!/usr/bin/env bash
# make bench: training throughput and quality benchmarks. Results go to build/bench/ and are
# summarised on stdout for docs/benchmarks.md. Not part of make test (timings are not asserted).
#
# 1. tinyshakespeare (if ../shared/data/tinyshakespeare.txt exists; it is never committed):
#    4 layers, hidden 128, 4 heads, context 64, batch 12, 2000 steps, AdamW lr 1e-3 (100 warm-up
#    steps, cosine to 1e-4), beta2 0.99, weight decay 0.1, clip 1.0, 90/10 split; 2 ranks.
# 2. fortunes (always available after make deps): same model and settings, 300 steps, at 1 and
#    2 ranks, for throughput.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
BIN=build/shardtrain
OUT=build/bench
mkdir -p "$OUT"
SHAKES=${SHAKESPEARE:-../shared/data/tinyshakespeare.txt}
COMMON=(--model demo --seq-len 64 --global-batch 12 --lr 1e-3 --min-lr 1e-4 --warmup 100 --beta2 0.99
  --weight-decay 0.1 --clip 1.0 --seed 1337 --log-every 100)

summary() {  # name np log
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
name, np, path = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [json.loads(l) for l in open(path)]
tr = [r for r in rows if "loss" in r]
ev = [r for r in rows if "val_loss" in r]
print(f"{name}: ranks {np}, steps {tr[-1]['step']}, final train loss {tr[-1]['loss']:.4f}, "
      f"val loss {ev[-1]['val_loss']:.4f}, wall {tr[-1]['elapsed_s']:.1f} s")
PY
  grep '^done:' "$OUT/$1.log" | sed 's/^/    /'
}

echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u +%Y-%m-%d)"
if [ -f "$SHAKES" ]; then
  $BIN --mode prepare --input "$SHAKES" --out "$OUT/shakespeare.tok" --val-fraction 0.1
  mpirun -np 2 $BIN "${COMMON[@]}" --data "$OUT/shakespeare.tok" --steps 2000 --eval-every 500 --eval-batches 100 \
    --metrics "$OUT/shakespeare.jsonl" >"$OUT/shakespeare.log" 2>&1
  summary shakespeare 2 "$OUT/shakespeare.jsonl"
else
  echo "tinyshakespeare: skipped ($SHAKES not found)"
fi
make -s data >/dev/null
for np in 1 2; do
  mpirun -np $np $BIN "${COMMON[@]}" --data build/data/fortunes.tok --steps 300 --eval-every 0 --eval-batches 10 \
    --metrics "$OUT/fortunes-np$np.jsonl" >"$OUT/fortunes-np$np.log" 2>&1
  summary "fortunes-np$np" $np "$OUT/fortunes-np$np.jsonl"
done

# 3. Checkpoint save/load: ~10.4M parameters = 125 MB of parameters + AdamW moments, 2 ranks, next
#    to the disk's raw sequential write speed (dd with fdatasync).
cat >"$OUT/ckpt-model.json" <<'J'
{"vocab_size": 258, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 3,
 "num_attention_heads": 8, "max_position_embeddings": 64, "tie_word_embeddings": true,
 "bos_token_id": 256, "eos_token_id": 257}
J
rm -rf "$OUT/ckpt"
for i in 1 2 3; do
  mpirun -np 2 $BIN --model "$OUT/ckpt-model.json" --data build/data/fortunes.tok --seq-len 16 --global-batch 2 \
    --steps 4 --stop-at-step $i --eval-batches 1 --checkpoint-dir "$OUT/ckpt" ${RESUME:-} 2>&1 | grep -E "^(checkpoint|resumed)"
  RESUME="--resume auto"
done
dd if=/dev/zero of="$OUT/dd.bin" bs=1M count=256 conv=fdatasync 2>&1 | tail -1 | sed 's/^/dd (256 MiB, conv=fdatasync): /'
rm -f "$OUT/dd.bin"
