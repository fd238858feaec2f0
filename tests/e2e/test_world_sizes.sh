#!/usr/bin/env bash
# One training run at world sizes 1, 2, 3 and 4 (same global batch 12, same seed) must give the
# same loss at each of 20 steps within 1e-5 relative. Model: preset test-uneven, whose every unit
# size is uneven over 3 and over 4 ranks (some ranks hold padding). Micro-batches differ per world
# size so that gradient accumulation is exercised too.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
declare -A MB=([1]=6 [2]=3 [3]=4 [4]=3)
for n in 1 2 3 4; do
  timeout -k 5 300 $MPIRUN -np $n "$BIN" --model test-uneven --data "$DATA" --seq-len 32 --global-batch 12 \
    --micro-batch "${MB[$n]}" --steps 20 --lr 3e-3 --warmup 5 --log-every 1 --eval-every 0 --eval-batches 1 \
    --threads 1 --metrics "$WORK/w$n.jsonl" >"$WORK/w$n.log" 2>&1 || { cat "$WORK/w$n.log"; fail "world size $n run failed"; }
done
python3 - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
def losses(n):
    rows = [json.loads(l) for l in open(f"{work}/w{n}.jsonl")]
    return [r["loss"] for r in rows if "loss" in r]
ref = losses(1)
assert len(ref) == 20, f"expected 20 steps, got {len(ref)}"
assert ref[-1] < ref[0] - 0.5, f"loss did not fall: {ref[0]} -> {ref[-1]}"
worst = 0.0
for n in (2, 3, 4):
    got = losses(n)
    assert len(got) == 20, f"world size {n}: {len(got)} steps"
    for s, (a, b) in enumerate(zip(ref, got), 1):
        rel = abs(a - b) / abs(a)
        worst = max(worst, rel)
        assert rel <= 1e-5, f"world size {n}, step {s}: loss {b} vs {a} at world size 1 (rel {rel:.2e})"
print(f"ok: 20 steps equal at world sizes 1-4, worst relative difference {worst:.2e}; loss {ref[0]:.4f} -> {ref[-1]:.4f}")
PY
