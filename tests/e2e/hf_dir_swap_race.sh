#!/usr/bin/env bash
# Issue 53's --hf-dir swap, as a race (not part of make test: its outcome depends on timing;
# tests/e2e/test_input_files.sh part 1b is the deterministic test, with the hook). Two models with
# the same file names and shapes, every file different: A, an export (multi-shard, a tokenizer file
# of its own), and B, a copy whose every tensor is other random values (numpy, seed 2), whose
# config.json says another rms_norm_eps and whose tokenizer_config.json another model_max_length.
# --hf-dir is a symbolic link that a loop points at A and at B in turn (an atomic rename of a fresh
# link every 0.2 ms) while --mode import runs RUNS times. Each checkpoint is classified by h5py
# against imports of A and of B (every dataset and attribute, as tests/e2e/h5_equal.py compares
# them): "A" (everything as A's import), "B", or "mixed" (some of each, or neither); an import may
# also be refused (counted, with its first error line). Exit status 1 if any is mixed.
# Usage: bash tests/e2e/hf_dir_swap_race.sh BUILD [RUNS=100] [NP=1]. Prints
# "hf-dir swap race: N runs (NP rank(s)), a from A, b from B, R refused, X mixed".
source "$(dirname "$0")/common.sh"
RUNS=${2:-100}
NP=${3:-1}
head -c 40000 /usr/share/games/fortunes/fortunes >"$WORK/small.txt"
"$BIN" --mode prepare --input "$WORK/small.txt" --out "$WORK/c.tok" >/dev/null
printf '{"vocab_size": 512, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64}\n' >"$WORK/m.json"
"$BIN" --model "$WORK/m.json" --data "$WORK/c.tok" --seq-len 16 --global-batch 2 --eval-batches 1 --threads 1 --steps 1 \
  --checkpoint-dir "$WORK/ck" >/dev/null
"$BIN" --mode export "$WORK/ck/step_00000001.h5" --out "$WORK/A" --max-shard-size 12KB >/dev/null
printf '{"model_max_length": 64}\n' >"$WORK/A/tokenizer_config.json"
cp -r "$WORK/A" "$WORK/B"
"$PY" - "$WORK/B" <<'PY'
import glob, json, sys
import numpy as np
from safetensors.numpy import load_file, save_file
from safetensors import safe_open
d, rng = sys.argv[1], np.random.default_rng(2)
for p in sorted(glob.glob(d + "/model-*.safetensors")):
    with safe_open(p, "np") as f:
        meta = f.metadata()
    t = load_file(p)
    save_file({k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in t.items()}, p, metadata=meta)
c = json.load(open(d + "/config.json"))
c["rms_norm_eps"] = c.get("rms_norm_eps", 1e-5) * 10
json.dump(c, open(d + "/config.json", "w"))
json.dump({"model_max_length": 32}, open(d + "/tokenizer_config.json", "w"))
PY
run_import() {  # DIR OUT LOG
  if [ "$NP" -eq 1 ]; then "$BIN" --mode import --hf-dir "$1" --out "$2" >"$3" 2>&1
  else timeout -k 5 120 $MPIRUN -np "$NP" "$BIN" --mode import --hf-dir "$1" --out "$2" >"$3" 2>&1; fi
}
run_import "$WORK/A" "$WORK/refA.h5" "$WORK/refA.log" || { cat "$WORK/refA.log"; fail "import of A failed"; }
run_import "$WORK/B" "$WORK/refB.h5" "$WORK/refB.log" || { cat "$WORK/refB.log"; fail "import of B failed"; }
ln -s A "$WORK/cur"
start_link_flipper "$WORK/cur" A B  # cur flips between A and B every 0.2 ms
trap 'kill $FLIP 2>/dev/null || true; rm -rf "$WORK"' EXIT
refused=0
: >"$WORK/refusals.txt"
t0=$SECONDS
for ((i = 1; i <= RUNS; i++)); do
  if ! run_import "$WORK/cur" "$WORK/run$i.h5" "$WORK/run.log"; then
    refused=$((refused + 1))
    grep -m1 "error" "$WORK/run.log" >>"$WORK/refusals.txt" || tail -1 "$WORK/run.log" >>"$WORK/refusals.txt"
    rm -f "$WORK/run$i.h5"
  fi
done
secs=$((SECONDS - t0))
kill $FLIP 2>/dev/null || true
# Classify every checkpoint written: one h5py process for all of them.
"$PY" - "$ROOT/tests/e2e" "$WORK" "$RUNS" >"$WORK/classes.txt" <<'PY'
import os, sys
sys.path.insert(0, sys.argv[1])
import h5py
from h5_equal import as_bytes, objects
work, runs = sys.argv[2], int(sys.argv[3])
def items(path):  # every dataset's and attribute's bytes, by path
    out = {}
    with h5py.File(path, "r") as f:
        for p, o in objects(f).items():
            if isinstance(o, h5py.Dataset):
                out[p] = as_bytes(o[()])
            for k, v in o.attrs.items():
                out[p + "@" + k] = as_bytes(v)
    return out
a, b = items(work + "/refA.h5"), items(work + "/refB.h5")
differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
print(f"# {len(differ)} of {len(set(a) | set(b))} items differ between A and B", file=sys.stderr)
for i in range(1, runs + 1):
    p = f"{work}/run{i}.h5"
    if not os.path.exists(p):
        continue
    o = items(p)
    if set(o) != set(a) | set(b) or any(o[k] != a.get(k) for k in set(o) - set(differ)):
        print(i, "mixed", "other items")
        continue
    na = sum(o[k] == a.get(k) for k in differ)
    nb = sum(o[k] == b.get(k) for k in differ)
    print(i, "A" if na == len(differ) else "B" if nb == len(differ) else "mixed", f"{na} as A, {nb} as B")
PY
fromA=$(awk '$2 == "A"' "$WORK/classes.txt" | wc -l)
fromB=$(awk '$2 == "B"' "$WORK/classes.txt" | wc -l)
mixed=$(awk '$2 == "mixed"' "$WORK/classes.txt" | wc -l)
awk '$2 == "mixed"' "$WORK/classes.txt" | head -5 | sed 's/^/mixed: run /'
[ "$refused" -eq 0 ] || sort "$WORK/refusals.txt" | uniq -c | head -5
echo "hf-dir swap race: $RUNS runs ($NP rank(s), $secs s), $fromA from A, $fromB from B, $refused refused, $mixed mixed"
[ "$mixed" -eq 0 ]
