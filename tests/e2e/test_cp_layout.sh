#!/usr/bin/env bash
# Context parallelism's layout (issue 41, without a CP training run: the model does not run CP yet):
#  0. The mesh at 6 ranks (make test runs mpi_tests at 1 to 4): every mesh with cp >= 2 of W = 6
#     (cp 2 x dp 3, cp 3 x tp 2, cp 2 x HSDP 3, cp 6, ...) against independent arithmetic.
#  1. Checkpoints of CP meshes read with h5py alone: the files tests/mpi/test_cp_checkpoint.cpp
#     writes through the parallel layer's checkpoint layouts at (dp_shard 2 x cp 2) and (cp 2 x
#     tp 2) are format version 5 with attribute `mesh`, their shard tables have the rows the
#     format says, their metadata checksums match (tests/e2e/ckpt_meta.py), and every stored
#     element equals the value the test gave it (the formula again, here in Python); the files
#     without cp stay versions 3 and 4 (the same test loads them back bitwise at other meshes);
#     --mode inspect names the mesh, and the four files, which hold the same values, export to the
#     same bytes.
#  2. --mode plan --cp N for llama-8b and llama-70b at 32,768 and 131,072 tokens on 80 GB and
#     141 GB GPUs: the title names CP, the K/V buffers of each method are listed, the activations
#     kept fall as 1 / cp (ratio of the printed MiB), and T > max_position_embeddings is refused at
#     any cp.
source "$(dirname "$0")/common.sh"
MPI_TESTS=$(realpath "$BUILD/mpi_tests")

# 0. The mesh at 6 ranks.
timeout -k 5 120 $MPIRUN -np 6 "$MPI_TESTS" --gtest_color=no --gtest_filter='Mesh.*' >"$WORK/mesh6.log" 2>&1 ||
  { tail -40 "$WORK/mesh6.log"; fail "Mesh tests at 6 ranks"; }
grep -q "OK \] Mesh.ContextParallelGroupsAgreeWithIndependentComputation" "$WORK/mesh6.log" ||
  { tail -20 "$WORK/mesh6.log"; fail "Mesh.ContextParallelGroupsAgreeWithIndependentComputation did not pass at 6 ranks"; }
echo "ok: the mesh at 6 ranks: every mesh with cp >= 2 agrees with independent arithmetic"

# 1. The files.
SHARDTRAIN_TEST_CP_CHECKPOINT_OUT=$WORK timeout -k 5 300 $MPIRUN -np 4 -x SHARDTRAIN_TEST_CP_CHECKPOINT_OUT \
  "$MPI_TESTS" --gtest_color=no --gtest_filter='CpCheckpoint.*' >"$WORK/mpi.log" 2>&1 || { tail -50 "$WORK/mpi.log"; fail "CpCheckpoint tests"; }
grep -q "PASSED  \] 3 tests" "$WORK/mpi.log" || { tail -30 "$WORK/mpi.log"; fail "CpCheckpoint: not 3 tests passed"; }
"$PY" - "$WORK" "$ROOT/tests/e2e" <<'PY' || fail "h5py view of the version 5 files"
import json, sys
import h5py, numpy as np
work, here = sys.argv[1:3]
sys.path.insert(0, here)
import ckpt_meta

def value(k, u, i):  # tests/mpi/test_cp_checkpoint.cpp's value(), canonical element i of unit u
    return np.float32(1000000 * k + 10000 * u + i % 9973) + np.float32(0.25)

def check(name, version, mesh, rows, tp_rows):
    path = f"{work}/{name}"
    assert ckpt_meta.problems(path) == [], (name, ckpt_meta.problems(path))
    with h5py.File(path, "r") as f:
        assert int(f.attrs["format_version"]) == version, (name, f.attrs["format_version"])
        assert int(f.attrs["world_size"]) == rows, (name, f.attrs["world_size"])
        if mesh is None:
            assert "mesh" not in f.attrs, name
        else:
            assert json.loads(f.attrs["mesh"]) == mesh, (name, f.attrs["mesh"])
            assert "tensor_parallel" not in f.attrs, name  # version 5 records the mesh once
        for uname, u in f["units"].items():
            idx, numel, S = int(u.attrs["index"]), int(u.attrs["numel"]), int(u.attrs["shard_size"])
            st = u["shard_table"][:]
            assert st.shape == (rows, 3), (name, uname, st.shape)
            for r in range(rows):
                assert list(st[r]) == [r * S, max(0, min(numel - r * S, S)), S - max(0, min(numel - r * S, S))]
            if tp_rows is None:
                assert "tp_shard_table" not in u, (name, uname)
            else:
                assert u["tp_shard_table"].shape == (tp_rows, 3), (name, uname, u["tp_shard_table"].shape)
            i = np.arange(S * rows, dtype=np.int64)
            for k, ds in enumerate(["params", "adam_m", "adam_v"]):
                want = np.where(i < numel, np.float32(1000000 * k + 10000 * idx) + (i % 9973).astype(np.float32)
                                + np.float32(0.25), np.float32(0))
                got = u[ds][:]
                assert got.dtype == np.float32 and np.array_equal(got, want), (name, uname, ds)
    print(f"ok: {name}: version {version}, mesh {mesh}, {rows} rows" + (f", TP shard table {tp_rows} rows" if tp_rows else ""))

check("cp2_dp2.h5", 5, {"tp": 1, "cp": 2, "dp_shard": 2, "dp_replicate": 1}, 4, None)
check("cp2_tp2.h5", 5, {"tp": 2, "cp": 2, "dp_shard": 1, "dp_replicate": 1}, 4, 2)
check("v3.h5", 3, None, 4, None)
check("v4.h5", 4, None, 4, 2)
PY
echo "ok: h5py reads the version 5 files (cp 2 x dp_shard 2; cp 2 x tp 2): mesh, rows, checksums and every element"
# The program's own readers: --mode inspect names the mesh; the four files hold the same values, so
# their exports (at 1 rank and at 3) are the same bytes.
# (Into a file first: grep -q leaving early would end inspect with SIGPIPE, a failure under pipefail.)
timeout -k 5 60 "$BIN" --mode inspect "$WORK/cp2_dp2.h5" >"$WORK/inspect_dp2.txt" 2>&1 || fail "inspect cp2_dp2.h5"
timeout -k 5 60 "$BIN" --mode inspect "$WORK/cp2_tp2.h5" >"$WORK/inspect_tp2.txt" 2>&1 || fail "inspect cp2_tp2.h5"
grep -qF "saved by a context-parallel run: world size 4: cp 2 x dp_shard 2 (attribute 'mesh'" "$WORK/inspect_dp2.txt" ||
  fail "inspect cp2_dp2.h5: no mesh line"
grep -qF "world size 4: tp 2 x cp 2 x dp_shard 1 x dp_replicate 1" "$WORK/inspect_tp2.txt" ||
  fail "inspect cp2_tp2.h5: no mesh line"
for f in v3 cp2_dp2 cp2_tp2 v4; do
  np=1; [ "$f" = cp2_tp2 ] && np=3
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" --mode export --checkpoint "$WORK/$f.h5" --out "$WORK/hf-$f" >"$WORK/export-$f.log" 2>&1 ||
    { cat "$WORK/export-$f.log"; fail "export of $f.h5"; }
  [ "$f" = v3 ] || cmp -s "$WORK/hf-v3/model.safetensors" "$WORK/hf-$f/model.safetensors" || fail "export of $f.h5 differs from v3.h5's"
done
echo "ok: --mode inspect names the mesh of version 5 files; exports of the cp 2 x dp 2, cp 2 x tp 2 (at 3 ranks) and version 4 files equal the version 3 file's, byte for byte"

# 2. --mode plan --cp N.
plan() { timeout -k 5 120 "$BIN" --mode plan --device cuda --precision bf16 --micro-batch 1 --world-size 8 \
  --activation-checkpointing full "$@" 2>&1; }
mib() { grep -m1 "$1" <<<"$2" | awk '{print $1}'; }
for model in llama-8b llama-70b; do
  for T in 32768 131072; do
    base=$(plan --model "$model" --seq-len "$T" --cp 1) || { echo "$base"; fail "plan $model T $T cp 1"; }
    a1=$(mib "activations kept for backward" "$base")
    # Each cp once, the methods and devices alternating (the whole matrix runs in-process in
    # tests/unit/test_cp_plan.cpp; this is the command line's end of it).
    i=0
    for cp in 2 4 8; do
      how=ring mem=80GB
      [ $(((i + ${#T}) % 2)) -eq 1 ] && how=allgather mem=141GB
      i=$((i + 1))
      out=$(plan --model "$model" --seq-len "$T" --cp "$cp" --cp-comm "$how" --device-memory "$mem") ||
        { echo "$out"; fail "plan $model T $T cp $cp $how $mem"; }
      grep -qF "CP $cp ($how; FSDP over dp_shard $((8 / cp)) x cp $cp)" <<<"$out" || { echo "$out"; fail "plan title lacks CP $cp"; }
      want="CP ring K/V buffers"; [ "$how" = allgather ] && want="CP all-gathered K/V buffers"
      grep -qF "$want" <<<"$out" || { echo "$out"; fail "plan $model cp $cp $how: no '$want' line"; }
      grep -qF "fits in $mem per rank at seq-len $T" <<<"$out" || { echo "$out"; fail "plan: no fit for $mem"; }
      a=$(mib "activations kept for backward" "$out")
      # The printed MiB (one decimal) of 1 / cp of the cp 1 activations.
      "$PY" -c "import sys; a1, a, cp = map(float, sys.argv[1:]); sys.exit(abs(a * cp - a1) > 0.05 * cp)" "$a1" "$a" "$cp" ||
        fail "plan $model T $T cp $cp: activations $a MiB, not $a1 / $cp"
    done
    echo "ok: plan $model T $T: activations $a1 MiB at cp 1, / 2, 4, 8 at cp 2, 4, 8; the K/V line of each method"
  done
done
for cp in 1 8; do
  out=$(plan --model llama-8b --seq-len 131072 --cp "$cp" --device-memory 80GB)
  echo "ok: llama-8b at 131,072 tokens, cp $cp: $(grep -A3 'fits in' <<<"$out" | tr '\n' ' ' | tr -s ' ')"
done
expect_fail plan_cp_max_pos "option '--seq-len' (262144) exceeds the model's max_position_embeddings (131072)" \
  1 --mode plan --model llama-8b --seq-len 262144 --micro-batch 1 --world-size 8 --cp 8
