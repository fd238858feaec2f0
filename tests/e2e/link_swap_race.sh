#!/usr/bin/env bash
# The reproduction of issue 39's link swap, as a race (not part of make test: its outcome depends on
# timing; tests/e2e/test_input_files.sh is the deterministic test). An exported multi-shard model
# whose model-00002-of-0000N.safetensors is a symbolic link that a loop flips every 0.2 ms between
# the file inside the directory and ../outside.safetensors (the same header, every float 7.0);
# --mode import runs RUNS times. Every import must either be refused or write a checkpoint bitwise
# equal (h5py, tests/e2e/h5_equal.py) to an import of the untouched directory: no outside byte.
# Usage: bash tests/e2e/link_swap_race.sh BUILD [RUNS=200]. Prints "link-swap race: N runs, S imported
# (all equal to the reference), R refused, X with outside bytes"; exit status 1 if X > 0.
source "$(dirname "$0")/common.sh"
RUNS=${2:-200}
head -c 40000 /usr/share/games/fortunes/fortunes >"$WORK/small.txt"
"$BIN" --mode prepare --input "$WORK/small.txt" --out "$WORK/c.tok" >/dev/null
printf '{"vocab_size": 512, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64}\n' >"$WORK/m.json"
"$BIN" --model "$WORK/m.json" --data "$WORK/c.tok" --seq-len 16 --global-batch 2 --eval-batches 1 --threads 1 --steps 1 \
  --checkpoint-dir "$WORK/ck" >/dev/null
"$BIN" --mode export "$WORK/ck/step_00000001.h5" --out "$WORK/hf" --max-shard-size 12KB >/dev/null
"$BIN" --mode import --hf-dir "$WORK/hf" --out "$WORK/ref.h5" >/dev/null
SHARD=$(cd "$WORK/hf" && ls model-00002-of-*.safetensors)
mv "$WORK/hf/$SHARD" "$WORK/hf/inside.safetensors"
"$PY" - "$WORK/hf/inside.safetensors" "$WORK/outside.safetensors" <<'PY'
import struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack_from("<Q", b)[0]
b[8 + n:] = struct.pack("<f", 7.0) * ((len(b) - 8 - n) // 4)
open(sys.argv[2], "wb").write(bytes(b))
PY
ln -s inside.safetensors "$WORK/hf/$SHARD"
start_link_flipper "$WORK/hf/$SHARD" inside.safetensors ../outside.safetensors  # every 0.2 ms
trap 'kill $FLIP 2>/dev/null; rm -rf "$WORK"' EXIT
ok=0 refused=0 leaked=0
for ((i = 1; i <= RUNS; i++)); do
  out=$WORK/run$i.h5
  if "$BIN" --mode import --hf-dir "$WORK/hf" --out "$out" >"$WORK/run.log" 2>&1; then
    if "$PY" "$ROOT/tests/e2e/h5_equal.py" "$WORK/ref.h5" "$out" >/dev/null 2>&1; then ok=$((ok + 1)); else leaked=$((leaked + 1)); fi
  else
    grep -q "outside of directory" "$WORK/run.log" || { cat "$WORK/run.log"; fail "run $i: refused for another reason"; }
    refused=$((refused + 1))
  fi
  rm -f "$out"
done
echo "link-swap race: $RUNS runs, $ok imported (all equal to the reference), $refused refused, $leaked with outside bytes"
[ "$leaked" -eq 0 ]
