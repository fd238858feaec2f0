#!/usr/bin/env bash
# Tensor parallelism (--tp N: Megatron-style with sequence parallelism; groups of N consecutive ranks
# split the heads, the MLP and the vocabulary, FSDP shards each rank's slice over the data-parallel
# ranks) on the CPU backend, with (tp, dp) meaning --tp tp at world size tp x dp:
#   1. fp32 losses of 20 steps at (2,1), (2,2), (4,1), (3,2) and (2,3) equal the single-rank run's
#      within 1e-5 relative at every step (tied head, test-tp); the untied head (test-tp-untied) at
#      (2,2) likewise. The TP runs are not the reference again: they report TP traffic, and their
#      losses differ from it in the last bits.
#   2. bf16 at (2,1) follows bf16 at (1,1) within 2e-2 (the bf16 tolerance of test_mixed_precision.sh).
#   3. TP inside hybrid sharding (W=4, --tp 2, --shard-group-size 2: 2 replica groups of one TP
#      group each) follows (1,1) within 1e-5; the topology line (the log's first) says both.
#   4. --activation-checkpointing selective and full, and --attention exact, at (2,1) follow (1,1)
#      within 1e-5.
#   5. The TP traffic of every step (metrics tp_bytes, tp_collectives) equals the formula, computed
#      here from the config, exactly: (2,1) and (4,1) with no and full recompute, bf16 at (2,1); and
#      per optimizer step, not per micro-batch, where it differs: 2 replica groups (item 3's run),
#      and 4 micro-batches of 3 with loss chunks of 40 tokens (3 per micro-batch), whose losses
#      also follow (1,1) within 1e-5. FSDP's bytes per step (fsdp_bytes) equal the scaling model's
#      bytes_per_step (scripts/scaling_model.py) at (2,2), (3,2), (2,3) and with 2 replica groups.
#   6. --tp that does not divide the world size, the attention heads, the key/value heads, the
#      intermediate size or the tokens of a micro-batch, and a shard group that is not whole TP
#      groups: refused on every rank with a message naming the rule, no hang.
#   7. --mode plan plans for TP ('TP 2' in its title) and refuses a --tp that does not divide
#      --world-size.
#   8. A checkpoint saved at (2,2) resumes at (1,3), (4,1) and (1,1) (below).
#   9. That file (format version 4) exports alike at -np 1 and 4 and reads with h5py alone (below).
#  10. Crafted TP records (checksums recomputed) are refused naming the file and the item (below).
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
STEPS=20
BASE=(--data "$DATA" --seq-len 32 --global-batch 12 --lr 3e-3 --log-every 1 --eval-every 0 --eval-batches 1
      --warmup 2 --threads 1)
run() {  # NAME NP ARGS...: a training run of $STEPS steps (ARGS may not repeat an option of BASE)
  local name=$1 np=$2
  shift 2
  timeout -k 5 300 $MPIRUN -np "$np" "$BIN" "${BASE[@]}" --steps "${N_STEPS:-$STEPS}" --metrics "$WORK/$name.jsonl" "$@" \
    >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name: run failed"; }
}
# compare REF RUN TOL [FIRST LAST]: the losses of steps FIRST..LAST (default 1..$STEPS) equal within
# TOL relative, and RUN logged no other step; prints the worst relative difference.
compare() {
  "$PY" - "$WORK/$1.jsonl" "$WORK/$2.jsonl" "$3" "${4:-1}" "${5:-$STEPS}" <<'PY'
import json, sys
def losses(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
tol, lo, hi = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
assert sorted(b) == list(range(lo, hi + 1)), f"the run logged steps {sorted(b)}, expected {lo}..{hi}"
worst = 0.0
for s in range(lo, hi + 1):
    assert s in a, f"step {s} missing in the reference"
    rel = abs(a[s] - b[s]) / abs(a[s])
    worst = max(worst, rel)
    assert rel <= tol, f"step {s}: loss {b[s]!r} vs {a[s]!r} (rel {rel:.2e} > {tol})"
if lo == 1:
    assert a[hi] < a[1] - 0.1, f"the reference loss did not fall ({a[1]} -> {a[hi]})"
print(f"{worst:.1e}")
PY
}
# tp_traffic NAME: every step record has tp_bytes > 0 and tp_collectives > 0 (a TP run).
tp_traffic() {
  "$PY" - "$WORK/$1.jsonl" <<'PY'
import json, sys
recs = [r for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
assert recs and all(r.get("tp_bytes", 0) > 0 and r.get("tp_collectives", 0) > 0 for r in recs), "no TP traffic"
PY
}
M=(--model test-tp)
MU=(--model test-tp-untied)

# 1. fp32 losses at every (tp, dp) against the single rank.
run ref 1 "${M[@]}"
! grep -q '"tp_bytes"' "$WORK/ref.jsonl" || fail "ref: a run without --tp reports TP traffic"
worst_all=0 summary=""
for tpdp in 2,1 2,2 4,1 3,2 2,3; do
  tp=${tpdp%,*} dp=${tpdp#*,}
  name=tp${tp}dp${dp}
  run "$name" $((tp * dp)) "${M[@]}" --tp "$tp"
  tp_traffic "$name" || fail "$name: metrics without TP traffic"
  w=$(compare ref "$name" 1e-5) || fail "($tp,$dp) vs (1,1)"
  summary+=" ($tp,$dp) $w,"
  worst_all=$(python3 -c "print(max($worst_all, $w))")
done
python3 -c "assert $worst_all > 0" || fail "every TP run repeats the reference's losses bit for bit: TP did not run"
echo "ok: fp32 losses of $STEPS steps equal (1,1)'s within 1e-5 at (tp, dp) =${summary%,} (worst relative differences)"
run uref 1 "${MU[@]}"
run utp2dp2 4 "${MU[@]}" --tp 2
tp_traffic utp2dp2 || fail "utp2dp2: metrics without TP traffic"
w=$(compare uref utp2dp2 1e-5) || fail "untied (2,2) vs (1,1)"
echo "ok: untied head: (2,2) follows (1,1) within 1e-5 for $STEPS steps (worst $w)"

# 2. bf16.
run bref 1 "${M[@]}" --precision bf16
run btp2 2 "${M[@]}" --precision bf16 --tp 2
w=$(compare bref btp2 2e-2) || fail "bf16 (2,1) vs bf16 (1,1)"
w2=$(compare ref btp2 2e-2) || fail "bf16 (2,1) vs fp32 (1,1)"
echo "ok: bf16 (2,1) follows bf16 (1,1) within 2e-2 for $STEPS steps (worst $w; against fp32 $w2)"

# 3. TP with hybrid sharding: 2 replica groups, each one TP group of 2 (dp_shard 1).
run hsdp 4 "${M[@]}" --tp 2 --shard-group-size 2
line=$(head -1 "$WORK/hsdp.log")
[[ $line == topology:* && $line == *"tensor parallel: 2 TP groups of 2 consecutive ranks"* &&
   $line == *"hybrid sharding: 2 replica groups"* ]] || fail "hsdp: first line: $line"
w=$(compare ref hsdp 1e-5) || fail "hsdp (--tp 2 --shard-group-size 2 at W=4) vs (1,1)"
echo "ok: --tp 2 --shard-group-size 2 at W=4 follows (1,1) within 1e-5 (worst $w); $line"

# 4. Recompute and exact attention under TP.
summary=""
for opt in "--activation-checkpointing selective" "--activation-checkpointing full" "--attention exact"; do
  name=tp2_${opt##* }
  run "$name" 2 "${M[@]}" --tp 2 $opt
  w=$(compare ref "$name" 1e-5) || fail "(2,1) $opt vs (1,1)"
  summary+=" ${opt##* } $w,"
done
echo "ok: (2,1) with recompute selective / full and exact attention follows (1,1) within 1e-5 (worst:${summary%,})"

# 5. TP bytes and collectives per step against the formula (every step record of rank 0's metrics).
N_STEPS=3 run tp4full 4 "${M[@]}" --tp 4 --activation-checkpointing full
run tp2acc 2 "${M[@]}" --tp 2 --micro-batch 3 --loss-chunk 40
w=$(compare ref tp2acc 1e-5) || fail "(2,1) with 4 micro-batches of 3 and loss chunks of 40 vs (1,1)"
echo "ok: (2,1) with 4 micro-batches of 3 and loss chunks of 40 tokens follows (1,1) within 1e-5 (worst $w)"
# tp_formula NAME TP WORLD ELEM_BYTES RECOMPUTE [MICRO_BATCH [LOSS_CHUNK]]: every step's tp_bytes and
# tp_collectives in NAME's metrics. Replicated norms: the formula holds for dp_shard = 1 only.
tp_formula() {
  "$PY" - "$WORK/$1.jsonl" "$2" "$3" "$4" "$5" "${6:-0}" "${7:-0}" <<'PY'
import json, sys
path, N, world, e, recompute = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
micro, loss_chunk = int(sys.argv[6]), int(sys.argv[7])
C, L, V, T, G = 96, 2, 263, 32, 12                       # test-tp; --seq-len, --global-batch
dp = world // N
B = micro or G // dp                                     # micro-batch (default: global / dp)
micro_batches = G // dp // B
BT = B * T
R = BT // N                                              # rows (tokens) per rank
full = recompute == "full"
ag_calls, rs_calls = (8 * L + 2, 5 * L + 2) if full else (6 * L + 2, 4 * L + 2)
mb_bytes = (ag_calls + rs_calls) * (N - 1) * R * C * e   # activations: all-gathers, reduce-scatters
mb_calls = ag_calls + rs_calls
Vl = -(-V // N)
chunk = min(loss_chunk or max(256, 2**24 // Vl), BT)     # --loss-chunk or default_loss_chunk(Vl), capped at BT
for start in range(0, BT, chunk):                        # cross-entropy per chunk of n tokens:
    n = min(chunk, BT - start)
    mb_bytes += (N - 1) * n * 4 + 2 * (N - 1) / N * 2 * n * 4  # all-gather of maxima, all-reduce of 2n
    mb_calls += 2
norms = 2 * L + 1                                        # replicated RMSNorm weights, all-reduced per step
want_bytes = micro_batches * mb_bytes + norms * 2 * (N - 1) / N * 4 * C
want_calls = micro_batches * mb_calls + norms
recs = [r for r in map(json.loads, open(path)) if "loss" in r]
assert recs, "no step records"
for r in recs:
    got_b, got_c = r["tp_bytes"], r["tp_collectives"]
    assert abs(got_b - want_bytes) <= 1e-12 * want_bytes and got_c == want_calls, (
        f"step {r['step']}: tp_bytes {got_b!r}, tp_collectives {got_c!r}; formula {want_bytes!r}, {want_calls}")
print(f"{len(recs)} steps x {want_bytes:,.0f} B in {want_calls} collectives")
PY
}
summary=""
for c in "tp2dp1 2 2 4 none" "tp4dp1 4 4 4 none" "tp2_full 2 2 4 full" "tp4full 4 4 4 full" "btp2 2 2 2 none" \
         "hsdp 2 4 4 none" "tp2acc 2 2 4 none 3 40"; do
  got=$(tp_formula $c) || fail "${c%% *}: TP bytes per step differ from the formula"
  summary+=" ${c%% *}: $got;"
done
echo "ok: TP bytes and collectives per step equal the formula exactly:${summary%;}"
# FSDP's bytes per step (metrics fsdp_bytes, rank 0's) against scripts/scaling_model.py's
# bytes_per_step (docs/scaling.md), under TP: each TP rank's slices sharded over dp_shard ranks; with
# 2 replica groups plus the replica all-reduce 2 (R - 1) / R x S x 4 of every reduce-scatter.
"$PY" - "$ROOT/scripts" "$WORK" <<'PY' || fail "FSDP bytes per step against the scaling model"
import json, sys
sys.path.insert(0, sys.argv[1])
import scaling_model as sm
cfg = sm.Config("test-tp", 263, 96, 72, 2, 24, 12, True)
out = []
for name, W, tp, R in [("tp2dp2", 4, 2, 1), ("tp3dp2", 6, 3, 1), ("tp2dp3", 6, 2, 1), ("hsdp", 4, 2, 2)]:
    got = [r["fsdp_bytes"] for r in map(json.loads, open(f"{sys.argv[2]}/{name}.jsonl")) if "loss" in r]
    ag, rs = sm.bytes_per_step(cfg, W // R, sm.Precision("fp32"), 1, tp)
    want = ag + rs
    if R > 1:  # the replica all-reduce of each reduce-scatter (one per unit; tied embedding: two)
        _, rs_counts = sm.collective_counts(cfg)
        want += sum(c * 2 * (R - 1) / R * sm.shard_size(n, W // R // tp) * 4
                    for c, (_, n) in zip(rs_counts, sm.units(cfg, tp)))
    assert got and all(abs(g - want) <= 1e-9 * want for g in got), (name, got[:3], want)
    out.append(f"{name} {want:,.0f} B")
print("; ".join(out))
PY
echo "ok: FSDP bytes per step equal scripts/scaling_model.py's bytes_per_step under TP (tp2dp2, tp3dp2, tp2dp3, and 2 replica groups)"

# 6. Refusals: every rank names the rule, no hang.
A=("${BASE[@]}" --steps 2)
expect_fail tp_world "option '--tp' (4) does not divide the world size (6)" 6 "${M[@]}" "${A[@]}" --tp 4
expect_fail tp_heads "does not divide the model's attention heads (24)" 5 "${M[@]}" "${A[@]}" --tp 5
expect_fail tp_kv_heads "does not divide the model's key/value heads (2)" 4 --model tiny "${A[@]}" --tp 4
cat >"$WORK/ffn38.json" <<'J'
{"architectures": ["LlamaForCausalLM"], "vocab_size": 263, "hidden_size": 32, "intermediate_size": 38,
 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
 "bos_token_id": 256, "eos_token_id": 257}
J
expect_fail tp_intermediate "does not divide the model's intermediate size (38)" 4 --model "$WORK/ffn38.json" "${A[@]}" --tp 4
expect_fail tp_tokens "does not divide the tokens of a micro-batch (1 x 33 = 33)" 2 "${M[@]}" --data "$DATA" --seq-len 33 \
  --global-batch 1 --steps 2 --threads 1 --tp 2
expect_fail tp_group1 "option '--shard-group-size' (1) is not a multiple of '--tp' (2)" 4 "${M[@]}" "${A[@]}" --tp 2 \
  --shard-group-size 1
expect_fail tp_group3 "option '--shard-group-size' (3) is not a multiple of '--tp' (2)" 6 "${M[@]}" "${A[@]}" --tp 2 \
  --shard-group-size 3

# 7. The memory plan.
timeout -k 5 60 $MPIRUN -np 1 "$BIN" --mode plan --model test-tp --tp 2 --world-size 4 --micro-batch 3 --seq-len 32 \
  >"$WORK/plan.log" 2>&1 || { cat "$WORK/plan.log"; fail "plan --tp 2 --world-size 4"; }
title=$(grep -m1 "^memory plan" "$WORK/plan.log") || { cat "$WORK/plan.log"; fail "plan: no title"; }
[[ $title == *"TP 2"* ]] || fail "plan: title without 'TP 2': $title"
echo "ok: --mode plan --tp 2: $title"
expect_fail plan_tp3 "option '--tp' (3) does not divide the world size (4)" 1 --mode plan --model test-tp --tp 3 \
  --world-size 4 --micro-batch 3 --seq-len 32

# 8. Checkpoints (format version 4): saved at (2,2) (a background save at step 4, the final one at
#    8), resumed from step 4 at (1,3), (4,1) and (1,1): steps 5-8 follow the uninterrupted run
#    within 1e-5. (That the parameters and both AdamW moments reshard element for element is
#    tests/mpi/test_tensor_parallel.cpp's TpCheckpoint test.)
N_STEPS=8 run ck22 4 "${M[@]}" --tp 2 --checkpoint-dir "$WORK/ck22" --checkpoint-every 4
grep -q "step 4: snapshot taken" "$WORK/ck22.log" || fail "ck22: the step-4 save was not a background save"
summary=""
for tpdp in 1,3 4,1 1,1; do
  tp=${tpdp%,*} dp=${tpdp#*,}
  mkdir -p "$WORK/rs$tp$dp" && cp "$WORK/ck22/step_00000004.h5" "$WORK/rs$tp$dp/"
  N_STEPS=8 run "rs$tp$dp" $((tp * dp)) "${M[@]}" --tp "$tp" --resume "$WORK/rs$tp$dp/step_00000004.h5"
  grep -q "resumed from .* at step 4 (saved at world size 4: tp 2 x dp_shard 2 x dp_replicate 1)" "$WORK/rs$tp$dp.log" \
    || { cat "$WORK/rs$tp$dp.log"; fail "($tp,$dp): no resume line naming the saved layout"; }
  w=$(compare ck22 "rs$tp$dp" 1e-5 5 8) || fail "resumed at ($tp,$dp) vs the uninterrupted (2,2) run"
  summary+=" ($tp,$dp) $w,"
done
echo "ok: a (2,2) checkpoint resumed at${summary%,} (worst relative differences of steps 5-8)"

# 9. The file: version 4, exported byte for byte alike at -np 1 and -np 4, and every parameter read
#    with h5py from param_table alone equals the export; the TP record follows the documented rules
#    (docs/checkpoint-format.md, "Version 4").
F=$WORK/ck22/step_00000008.h5
for n in 1 4; do
  timeout -k 5 120 $MPIRUN -np $n "$BIN" --mode export "$F" --out "$WORK/hf$n" >"$WORK/export$n.log" 2>&1 \
    || { cat "$WORK/export$n.log"; fail "export at -np $n"; }
done
cmp "$WORK/hf1/model.safetensors" "$WORK/hf4/model.safetensors" || fail "exports at -np 1 and -np 4 differ"
timeout -k 5 60 $MPIRUN -np 1 "$BIN" --mode inspect "$F" >"$WORK/inspect.log" 2>&1 || { cat "$WORK/inspect.log"; fail "inspect"; }
grep -q "saved by a tensor-parallel run: tp 2 x dp_shard 2 x dp_replicate 1" "$WORK/inspect.log" || fail "inspect: no TP line"
"$PY" - "$F" "$WORK/hf1/model.safetensors" <<'PY' || fail "h5py view of the version 4 file"
import json, sys
import h5py, numpy as np
from safetensors.numpy import load_file
f, exported = h5py.File(sys.argv[1], "r"), load_file(sys.argv[2])
assert f.attrs["format_version"] == 4, f.attrs["format_version"]
mesh = json.loads(f.attrs["tensor_parallel"])
N, D = mesh["tp"], mesh["dp_shard"]
assert (N, D, mesh["dp_replicate"]) == (2, 2, 1) and f.attrs["world_size"] == N * D
seen = 0
for unit in f["units"].values():
    flat = unit["params"][:]
    local_numel, S = int(unit.attrs["local_numel"]), int(unit.attrs["local_shard_size"])
    for row, tp in zip(unit["param_table"][:], unit["tp_table"][:]):
        name = row["name"].decode()
        w = flat[row["offset"] : row["offset"] + row["numel"]].reshape(tuple(row["shape"][: row["ndim"]]))
        want = exported[name]
        assert w.shape == want.shape and np.array_equal(w, want), name
        split, degree, padded_rows, local_offset = (int(x) for x in tp)
        expect = -1 if "norm" in name else 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        assert (split, degree) == (expect, N), (name, split, degree)
        assert padded_rows == (-w.shape[0] % N if split == 0 else 0), (name, padded_rows)
        assert 0 <= local_offset < local_numel
        seen += 1
    assert S == max(1, -(-local_numel // D))
    for d, (start, valid, pad) in enumerate(unit["tp_shard_table"][:]):
        assert (start, valid, pad) == (d * S, min(max(local_numel - d * S, 0), S), S - min(max(local_numel - d * S, 0), S))
assert seen == len(exported), (seen, len(exported))  # every exported tensor, read from the file
print(f"{seen} tensors")
PY
echo "ok: the version 4 file exports byte for byte alike at -np 1 and -np 4; h5py reads every parameter from param_table alone, equal to the export, and the TP record follows its rules"

# 10. Crafted version 4 files, their metadata checksums recomputed (so that the semantic checks,
#     not the CRC32s, must refuse them): a TP record that is not the model's, or a mesh that is not
#     one, is refused naming the file and the item (--mode inspect reads the record).
for mut in local_numel split_swap padded_rows mesh_float shard_row layers_huge; do
  "$PY" - "$F" "$WORK/bad_$mut.h5" "$mut" <<'PY' || fail "crafting $mut"
import h5py, json, shutil, sys, zlib
import numpy as np
src, dst, mut = sys.argv[1:4]
shutil.copy(src, dst)
f = h5py.File(dst, "r+")
sums = json.loads(f.attrs["metadata_crc32"])
U, E = "units/model.layers.0", "units/model.embed_tokens"
def table(path, a):  # int64 table, its checksum as the writer computes it (little-endian rows)
    del f[path]; f.create_dataset(path, data=a); sums[path] = zlib.crc32(a.astype("<i8").tobytes())
if mut == "local_numel":
    v = int(f[U].attrs["local_numel"]) + 1
    del f[U].attrs["local_numel"]; f[U].attrs["local_numel"] = np.int64(v)
    sums[U + "@local_numel"] = zlib.crc32(v.to_bytes(8, "little", signed=True))
elif mut == "split_swap":  # q_proj recorded as row-parallel
    t = f[U + "/tp_table"][:]; t[1, 0] = 1; table(U + "/tp_table", t)
elif mut == "padded_rows":
    t = f[E + "/tp_table"][:]; t[0, 2] += 2; table(E + "/tp_table", t)
elif mut == "mesh_float":
    s = '{"dp_replicate":1,"dp_shard":2,"tp":2.5}'
    del f.attrs["tensor_parallel"]; f.attrs["tensor_parallel"] = s; sums["@tensor_parallel"] = zlib.crc32(s.encode())
elif mut == "shard_row":
    t = f[U + "/tp_shard_table"][:]; t[0] += 1; table(U + "/tp_shard_table", t)
elif mut == "layers_huge":  # the TP record's check must validate the config before building its units
    c = json.loads(f.attrs["model_config"]); c["num_hidden_layers"] = 2**31 - 1
    m = json.dumps(c, separators=(",", ":"), sort_keys=True)
    del f.attrs["model_config"]; f.attrs["model_config"] = m; sums["@model_config"] = zlib.crc32(m.encode())
s = json.dumps(sums, separators=(",", ":"))
del f.attrs["metadata_crc32"]; f.attrs["metadata_crc32"] = s
del f.attrs["metadata_crc32_check"]; f.attrs["metadata_crc32_check"] = np.int64(zlib.crc32(s.encode()))
PY
  # (4 GB of address space: a check that allocated the crafted model's units fails at once.)
  if (ulimit -v 4000000; timeout -k 5 60 $MPIRUN -np 1 "$BIN" --mode inspect "$WORK/bad_$mut.h5") >"$WORK/bad_$mut.log" 2>&1; then
    cat "$WORK/bad_$mut.log"; fail "crafted $mut: accepted"
  fi
  grep -q "error .*bad_$mut.h5'.*\(tp_table\|tp_shard_table\|local_numel\|tensor_parallel\)" "$WORK/bad_$mut.log" \
    || { cat "$WORK/bad_$mut.log"; fail "crafted $mut: the message does not name the file and the item"; }
done
echo "ok: crafted version 4 files (local_numel, split, padded rows, a float in the mesh, a shard row, 2^31 layers) refused by name"
