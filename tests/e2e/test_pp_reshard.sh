#!/usr/bin/env bash
# '--pp-reshard' (issue 42 item 5): at 4 ranks, --pp 2 x dp 2, demo config, 20 steps of m = 8
# micro-batches per rank, per-step (each unit of a stage all-gathered once per step and its
# gradient reduce-scattered once) against per-microbatch (gathered in each micro-batch's forward
# and backward, reduce-scattered per micro-batch): losses and gradient norms within 1e-6 relative
# in fp32 (the gradient sums differ in order only), and fsdp_bytes of the metrics smaller by m to
# 2m (per-microbatch moves about 3 unit volumes per micro-batch: 2 gathers and a reduce; per-step
# 2 per step). A bad value is refused naming the option.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
CONFIG=$(dirname "$0")/../bench/demo-config.json

run() {  # NAME ARGS...
  local name=$1
  shift
  timeout -k 5 600 $MPIRUN -np 4 "$BIN" --model "$CONFIG" --data "$DATA" --seq-len 64 --global-batch 16 \
    --micro-batch 1 --steps 20 --warmup 5 --log-every 1 --threads 1 --eval-every 0 --eval-batches 1 --lr 1e-3 \
    --min-lr 1e-4 --beta2 0.99 --weight-decay 0.1 --clip 1.0 --seed 1337 --pp 2 --metrics "$WORK/$name.jsonl" "$@" \
    >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name: run failed"; }
}

# compare A B TOL M: per-step losses and gradient norms within TOL relative; fsdp_bytes of B (per
# micro-batch) over A's (per step) in [M, 2M].
compare() {
  python3 - "$WORK" "$@" <<'PY' || fail "$2 against $1"
import json, sys
work, a, b, tol, m = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
def rows(n):
    return {r["step"]: r for r in map(json.loads, filter(str.strip, open(f"{work}/{n}.jsonl"))) if "loss" in r}
ra, rb = rows(a), rows(b)
assert sorted(ra) == sorted(rb) and len(ra) == 20, f"steps differ: {sorted(ra)} {sorted(rb)}"
worst = max(max(abs(ra[s][k] - rb[s][k]) / abs(rb[s][k]) for k in ("loss", "grad_norm")) for s in ra)
assert worst <= tol, f"worst relative difference {worst:.3g} > {tol}"
fa = sum(r["fsdp_bytes"] for r in ra.values()) / len(ra)
fb = sum(r["fsdp_bytes"] for r in rb.values()) / len(rb)
assert m <= fb / fa <= 2 * m, f"fsdp_bytes per step {fa:.0f} ({a}) vs {fb:.0f} ({b}): ratio {fb / fa:.2f} not in [{m}, {2 * m}]"
print(f"ok: {a} vs {b}: 20 steps, worst relative loss / grad-norm difference {worst:.2e}; fsdp_bytes per step "
      f"{fa:.0f} vs {fb:.0f} ({fb / fa:.2f}x, m = {m}); final loss {ra[20]['loss']:.6f} vs {rb[20]['loss']:.6f}")
PY
}

run per_step --pp-reshard per-step
run per_microbatch --pp-reshard per-microbatch
run default
compare per_step per_microbatch 1e-6 8
python3 - "$WORK" <<'PY' || fail "the default is not per-step"
import json, sys
rows = lambda n: [(r["step"], r["loss"]) for r in map(json.loads, filter(str.strip, open(f"{sys.argv[1]}/{n}.jsonl"))) if "loss" in r]
assert rows("default") == rows("per_step")
print("ok: the default is per-step (bitwise the same losses)")
PY
expect_fail bad_reshard "pp-reshard" 1 --model "$CONFIG" --data "$DATA" --pp-reshard sometimes
echo "PASS: test_pp_reshard"
