#!/usr/bin/env bash
# Hybrid sharding (--shard-group-size G, HSDP): parameters sharded within groups of G consecutive
# ranks, replicated over the W / G groups, gradients averaged over all W ranks.
#   1. fp32 losses equal plain FSDP at the same world size within 1e-5 relative: W=4,G=2 and
#      W=6,G=3 (and W=6,G=2: three replica groups); bf16 at W=4,G=2 (fp32 and bf16 gradient reduce).
#   2. The checkpoint of W=4,G=2 is one logical copy: world_size 2, shard tables of 2 rows, the
#      run's layout in train_config, valid metadata checksums, tensors equal to plain FSDP's; no
#      replica divergence was reported (the save compares every replica's slice checksums).
#   3. Resume of that checkpoint (stopped at step 4) in plain FSDP at W=3 continues the losses of
#      an uninterrupted run within 1e-5.
#   4. G that does not divide W: refused on every rank naming the flag, no hang.
#   5. '--shard-group-size node' with SHARDTRAIN_TEST_RANKS_PER_NODE=2 (test hook): 2 nodes x 2.
#   6. --mode plan shards over G.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
STEPS=8
BASE=(--model test-uneven --data "$DATA" --seq-len 32 --global-batch 12 --lr 3e-3 --log-every 1 --eval-every 0
      --eval-batches 1 --threads 1)
ARGS=("${BASE[@]}" --steps $STEPS --warmup 2)
run() {  # NAME NP ARGS...: a training run with ARGS (or "${BASE[@]}" when SHORT=1: the caller gives --steps)
  local name=$1 np=$2
  shift 2
  local a=("${ARGS[@]}")
  [ "${SHORT:-0}" = 1 ] && a=("${BASE[@]}")
  timeout -k 5 300 $MPIRUN -np "$np" "$BIN" "${a[@]}" --metrics "$WORK/$name.jsonl" "$@" >"$WORK/$name.log" 2>&1 \
    || { cat "$WORK/$name.log"; fail "$name: run failed"; }
  if grep -q "replica groups hold different" "$WORK/$name.log"; then cat "$WORK/$name.log"; fail "$name: replicas diverged"; fi
}
# compare A B FROM TO TOL: losses of steps FROM..TO equal within TOL relative.
compare() {
  "$PY" - "$WORK/$1.jsonl" "$WORK/$2.jsonl" "$3" "$4" "$5" <<'PY'
import json, sys
def losses(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
lo, hi, tol = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
worst = 0.0
for s in range(lo, hi + 1):
    assert s in a and s in b, f"step {s} missing"
    rel = abs(a[s] - b[s]) / abs(a[s])
    worst = max(worst, rel)
    assert rel <= tol, f"step {s}: loss {b[s]} vs {a[s]} (rel {rel:.2e} > {tol})"
print(f"{worst:.2e}")
PY
}

# 1. Losses: HSDP against plain FSDP at the same world size.
run p4 4 --checkpoint-dir "$WORK/ck_p4"
run h4 4 --shard-group-size 2 --checkpoint-dir "$WORK/ck_h4"
grep -q "^topology: 1 node x 4 ranks per node (world 4); hybrid sharding: 2 replica groups of 2 ranks (shard group size 2)$" \
  "$WORK/h4.log" || { head -3 "$WORK/h4.log"; fail "h4: no topology line"; }
[ "$(head -1 "$WORK/h4.log" | cut -c1-9)" = "topology:" ] || fail "h4: the topology line is not the first line"
grep -q "^topology: .*; fully sharded over all 4 ranks (shard group size 4)$" "$WORK/p4.log" || fail "p4: no topology line"
w=$(compare p4 h4 1 $STEPS 1e-5) || fail "W=4: HSDP G=2 vs plain FSDP"
echo "ok: W=4, G=2 follows plain FSDP for $STEPS steps (worst relative difference $w)"
run p6 6
run h6 6 --shard-group-size 3
w=$(compare p6 h6 1 $STEPS 1e-5) || fail "W=6: HSDP G=3 vs plain FSDP"
run h6r3 6 --shard-group-size 2 --checkpoint-dir "$WORK/ck_h6r3"
w2=$(compare p6 h6r3 1 $STEPS 1e-5) || fail "W=6: HSDP G=2 (3 replica groups) vs plain FSDP"
echo "ok: W=6, G=3 and G=2 follow plain FSDP for $STEPS steps (worst relative differences $w, $w2)"
run b4 4 --precision bf16
run hb4 4 --precision bf16 --shard-group-size 2
w=$(compare b4 hb4 1 $STEPS 1e-5) || fail "bf16 W=4: HSDP G=2 vs plain FSDP"
run br4 4 --precision bf16 --reduce-dtype bf16
run hbr4 4 --precision bf16 --reduce-dtype bf16 --shard-group-size 2
# bf16 gradient reduce: the plain run sums 4 bf16 blocks (rounding each pairwise step), HSDP sums
# 2 in bf16 and the replicas in fp32: the gradients differ by bf16 rounding, not by more.
w2=$(compare br4 hbr4 1 $STEPS 2e-3) || fail "bf16 (bf16 reduce) W=4: HSDP G=2 vs plain FSDP"
echo "ok: bf16 at W=4, G=2 follows plain FSDP: fp32 reduce within 1e-5 ($w), bf16 reduce within 2e-3 ($w2)"
# Gradient accumulation (4 micro-batches of 1 per step) under each progress mode: a tester found
# HSDP hanging here with poll progress (the replica sum then blocked inside a polled step; the
# ranks waited on each other across the two communicators). --collective-timeout makes a hang fail.
for prog in poll thread wait; do
  run pa4_$prog 4 --micro-batch 1 --collective-timeout 60 --comm-progress $prog
  run ha4_$prog 4 --micro-batch 1 --collective-timeout 60 --comm-progress $prog --shard-group-size 2
  w=$(compare pa4_$prog ha4_$prog 1 $STEPS 1e-5) || fail "accumulation, $prog: HSDP G=2 vs plain FSDP"
  run hba4_$prog 4 --micro-batch 1 --collective-timeout 60 --comm-progress $prog --shard-group-size 2 --precision bf16 \
    --reduce-dtype bf16
done
echo "ok: HSDP with gradient accumulation under poll, thread and wait progress (fp32 and bf16 reduce) completes; fp32 follows plain FSDP"

# 2. The HSDP checkpoint: one logical copy for G ranks, the same tensors as plain FSDP's.
CK=$(printf 'step_%08d.h5' $STEPS)
"$PY" "$ROOT/tests/e2e/ckpt_meta.py" verify "$WORK/ck_h4/$CK" || fail "HSDP checkpoint: metadata checksums"
"$PY" - "$WORK/ck_p4/$CK" "$WORK/ck_h4/$CK" "$WORK/ck_h6r3/$CK" <<'PY' || fail "HSDP checkpoint contents"
import json, sys
import h5py, numpy as np
def tensors(path):
    out = {}
    with h5py.File(path, "r") as f:
        for name, u in f["units"].items():
            for k in ("params", "adam_m", "adam_v"):
                out[name + "/" + k] = u[k][: int(u.attrs["numel"])]
    return out
with h5py.File(sys.argv[2], "r") as f:
    assert int(f.attrs["world_size"]) == 2, f"world_size {f.attrs['world_size']}, expected 2 (the shard group)"
    tc = json.loads(f.attrs["train_config"])
    assert tc["world_size"] == 4 and tc["shard_group_size"] == 2, tc
    for name, u in f["units"].items():
        assert u["shard_table"].shape == (2, 3) and u["shard_crc32"].shape == (2, 3), name
        S = int(u.attrs["shard_size"])
        assert S == max(1, -(-int(u.attrs["numel"]) // 2)), name
with h5py.File(sys.argv[1], "r") as f:
    assert int(f.attrs["world_size"]) == 4 and f["units/model.embed_tokens"]["shard_table"].shape == (4, 3)
ref = tensors(sys.argv[1])
for path in sys.argv[2:]:
    got = tensors(path)
    assert ref.keys() == got.keys()
    worst = 0.0
    for k in ref:
        d = float(np.max(np.abs(ref[k] - got[k]) / (np.abs(ref[k]) + 1e-3)))
        worst = max(worst, d)
        assert d < 1e-3, f"{path}: {k} differs from plain FSDP's (max relative {d:.2e})"
    print(f"ok: {path.split('/')[-2]}: {len(ref)} tensors equal plain FSDP's (worst relative {worst:.1e})")
PY
echo "ok: HSDP checkpoints hold one copy (shard tables of G rows), replicas identical at save"

# 3. Resume a W=4, G=2 checkpoint in plain FSDP at W=3: the losses of the uninterrupted run.
run half1 4 --shard-group-size 2 --checkpoint-dir "$WORK/ck_r" --stop-at-step 4
run half2 3 --checkpoint-dir "$WORK/ck_r" --resume "$WORK/ck_r/step_00000004.h5"
grep -q "resumed from .* at step 4 (saved at world size 4, shard group size 2)" "$WORK/half2.log" \
  || { cat "$WORK/half2.log"; fail "half2: no resume line naming the saved layout"; }
w=$(compare p4 half2 5 $STEPS 1e-5) || fail "resume G=2, W=4 -> plain W=3"
# ... and the plain W=3 checkpoint back into HSDP at W=6, G=3 (loading at any G).
SHORT=1 run half3 6 --shard-group-size 3 --checkpoint-dir "$WORK/ck_r2" --init-from "$WORK/ck_r/step_00000004.h5" --steps 2 --warmup 1
echo "ok: a W=4, G=2 checkpoint resumes in plain FSDP at W=3 with the uninterrupted losses (worst $w); loads at W=6, G=3"

# 4. G must divide W: every rank names the flag, no hang.
expect_fail g3 "option '--shard-group-size' (3) does not divide the world size (4)" 4 "${ARGS[@]}" --shard-group-size 3
expect_fail gx "option '--shard-group-size' must be a positive integer or 'node', got 'two'" 2 "${ARGS[@]}" --shard-group-size two
expect_fail gempty "option '--shard-group-size' must be a positive integer or 'node', got ''" 2 "${ARGS[@]}" --shard-group-size ""
expect_fail plannode "option '--shard-group-size' 'node' with '--world-size 32'" 1 --mode plan --model test-uneven \
  --world-size 32 --shard-group-size node --micro-batch 1 --seq-len 32

# 5. 'node' with the test hook emulating 2 ranks per node.
# (mpirun starts the ranks of one host with its own environment: the variable reaches every rank.)
SHARDTRAIN_TEST_RANKS_PER_NODE=2 SHORT=1 run node 4 --shard-group-size node --steps 2 --warmup 1
line=$(head -1 "$WORK/node.log")
[[ $line == "topology: 2 nodes x 2 ranks per node (world 4); hybrid sharding: 2 replica groups of 2 ranks (shard group size 2); nodes emulated by SHARDTRAIN_TEST_RANKS_PER_NODE=2 (test hook)" ]] \
  || fail "node: unexpected first line: $line"
! grep -q "span several nodes" "$WORK/node.log" || fail "node: groups of consecutive ranks said to span nodes"
SHARDTRAIN_TEST_RANKS_PER_NODE=3 expect_fail node3 "'node' needs the same number of ranks on every node" 4 \
  "${ARGS[@]}" --shard-group-size node
echo "ok: --shard-group-size node: $line"
# The job-file key, either spelling.
printf 'shard_group_size = 2\n' >"$WORK/hsdp.ini"
SHORT=1 run ini 4 --config "$WORK/hsdp.ini" --steps 2 --warmup 1
grep -q "^topology: .*hybrid sharding: 2 replica groups of 2 ranks (shard group size 2)$" "$WORK/ini.log" \
  || { head -3 "$WORK/ini.log"; fail "job file key shard_group_size not applied"; }
echo "ok: job-file key shard_group_size = 2"

# 6. The memory plan shards over G.
"$BIN" --mode plan --model test-uneven --world-size 4 --micro-batch 1 --seq-len 32 >"$WORK/plan4.log" 2>&1 || fail "plan W=4"
"$BIN" --mode plan --model test-uneven --world-size 4 --shard-group-size 2 --micro-batch 1 --seq-len 32 >"$WORK/plan42.log" 2>&1 \
  || { cat "$WORK/plan42.log"; fail "plan W=4, G=2"; }
"$BIN" --mode plan --model test-uneven --world-size 2 --micro-batch 1 --seq-len 32 >"$WORK/plan2.log" 2>&1 || fail "plan W=2"
shards() { grep -oE '[0-9,]+ shard elements' "$1" | head -1; }
[ "$(shards "$WORK/plan42.log")" = "$(shards "$WORK/plan2.log")" ] || fail "plan: G=2 shards $(shards "$WORK/plan42.log"), W=2: $(shards "$WORK/plan2.log")"
[ "$(shards "$WORK/plan42.log")" != "$(shards "$WORK/plan4.log")" ] || fail "plan: G=2 shards like W=4"
grep -q "4 ranks (shard group size 2)" "$WORK/plan42.log" || { cat "$WORK/plan42.log"; fail "plan: no shard group size"; }
echo "ok: --mode plan with --shard-group-size 2 at W=4: $(shards "$WORK/plan42.log") per rank (as W=2)"
