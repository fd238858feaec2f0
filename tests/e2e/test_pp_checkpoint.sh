#!/usr/bin/env bash
# Checkpoints under pipeline parallelism (issue 42, item 6; docs/checkpoint-format.md, "Version 6"):
#  1. demo-config (tied embedding, 4 blocks) trains 20 steps straight at pp 2 x dp 2 (4 ranks,
#     asynchronous saves, the default), saving at step 10; the file is version 6 as h5py reads it
#     (mesh with pp, pipeline record, each unit's stage, the embedding stored once, metadata
#     checksums by tests/e2e/ckpt_meta.py).
#  2. It resumes at pp 4 x dp 1 and pp 2 x tp 2 (4 ranks each; pp 1 x dp 4: test_pipeline.sh): the
#     losses of steps 11-20 equal the straight run's within 1e-5 relative (the worst is printed).
#  3. Its parameters and both AdamW moments, rebuilt with h5py alone, equal those of a pp 1 x dp 4
#     run's step 10 within 1e-5 of each tensor's scale (tests/e2e/pp_ckpt_compare.py; not bitwise:
#     the two runs sum their gradients in different orders, their losses agree within 1e-8).
#  4. tests/mpi/test_pp_checkpoint.cpp (exact values, resharded bitwise at pp 1, 2, 4, tp, HSDP; a
#     differing tied copy refused at save; make test runs it here only) keeps its files: the pp 2 x
#     dp 2, pp 2 x tp 2 and interleaved files export (HF safetensors) to the same bytes as the pp 1
#     file of the same values (pp 2 x tp 2 at 1 and 3 ranks); --mode inspect names the pipeline.
#  5. Crafted version 6 files (bad 'pipeline' bounds; a unit's 'stage' contradicting them) are
#     refused on every rank with the file and the key named, no hang.
source "$(dirname "$0")/common.sh"
MPI_TESTS=$(realpath "$BUILD/mpi_tests")
CONFIG=$ROOT/tests/bench/demo-config.json
DATA=$(test_corpus)
ARGS=(--model "$CONFIG" --data "$DATA" --seq-len 32 --global-batch 8 --micro-batch 1 --steps 20 --device cpu
      --threads 1 --log-every 1 --eval-every 0)
run() {  # NAME NP ARGS...: a training run that must succeed
  local name=$1 np=$2
  shift 2
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" "${ARGS[@]}" "$@" --metrics "$WORK/$name.jsonl" >"$WORK/$name.log" 2>&1 ||
    { tail -30 "$WORK/$name.log"; fail "$name"; }
}

# 1. The straight run at pp 2 x dp 2, and a pp 1 x dp 4 run to step 10 for the comparison.
run straight 4 --pp 2 --checkpoint-dir "$WORK/pp2" --checkpoint-every 10
grep -q "writing in the background" "$WORK/straight.log" || fail "the step-10 save was not asynchronous"
run pp1 4 --checkpoint-dir "$WORK/pp1" --checkpoint-every 10 --stop-at-step 10
F=$WORK/pp2/step_00000010.h5
"$PY" - "$F" "$ROOT/tests/e2e" <<'PY' || fail "h5py view of the version 6 file"
import json, sys
import h5py
path, here = sys.argv[1:3]
sys.path.insert(0, here)
import ckpt_meta
assert ckpt_meta.problems(path) == [], ckpt_meta.problems(path)
with h5py.File(path, "r") as f:
    assert int(f.attrs["format_version"]) == 6
    assert json.loads(f.attrs["mesh"]) == {"pp": 2, "tp": 1, "cp": 1, "dp_shard": 2, "dp_replicate": 1}, f.attrs["mesh"]
    assert json.loads(f.attrs["pipeline"]) == {"pp": 2, "virtual": 1, "schedule": "1f1b", "bounds": [0, 2, 4]}
    assert int(f.attrs["world_size"]) == 2  # one stage's shard group
    names = sorted(f["units"])
    assert names == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3",
                     "model.norm"], names  # the tied embedding once
    stages = {n: int(f["units"][n].attrs["stage"]) for n in names}
    assert stages == {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                      "model.layers.3": 1, "model.norm": 1}, stages
    for n in names:
        assert f["units"][n]["shard_table"].shape == (2, 3)
print("ok: h5py: version 6, mesh with pp 2, pipeline bounds [0, 2, 4], stages 0 0 0 1 1 1, the embedding once, "
      "metadata checksums verified")
PY

# 2. Resumes at other meshes.
for cfg in "pp4_dp1:--pp 4" "pp2_tp2:--pp 2 --tp 2"; do  # pp 1 x dp 4: tests/e2e/test_pipeline.sh
  name=${cfg%%:*}
  read -r -a extra <<<"${cfg#*:}"
  run "resume_$name" 4 "${extra[@]}" --resume "$F"
  grep -q "resumed from '$F' at step 10 (saved at pp 2 (1f1b) x world size 2 per stage" "$WORK/resume_$name.log" ||
    { cat "$WORK/resume_$name.log"; fail "resume $name: no resume line"; }
  "$PY" - "$WORK/straight.jsonl" "$WORK/resume_$name.jsonl" "$name" <<'PY' || fail "resume $name: losses differ"
import json, sys
def losses(p):
    return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "loss" in j}
a, b, name = losses(sys.argv[1]), losses(sys.argv[2]), sys.argv[3]
assert sorted(b) == list(range(11, 21)), sorted(b)
worst = max(abs(b[s] - a[s]) / abs(a[s]) for s in b)
print(f"ok: resume at {name}: losses of steps 11-20 within {worst:.2e} relative of the straight pp 2 x dp 2 run")
sys.exit(0 if worst <= 1e-5 else 1)
PY
done

# 3. Parameters and moments against the pp 1 run's.
"$PY" "$ROOT/tests/e2e/pp_ckpt_compare.py" "$F" "$WORK/pp1/step_00000010.h5" 1e-5 >"$WORK/compare.txt" ||
  { cat "$WORK/compare.txt"; fail "the pp 2 x dp 2 file's tensors differ from the pp 1 x dp 4 file's"; }
sed 's/^/  /' "$WORK/compare.txt"
echo "ok: step 10 of pp 2 x dp 2 and of pp 1 x dp 4: parameters, adam_m, adam_v equal within 1e-5 of each tensor's scale"

# 4. The MPI test's files: exports of the same values are the same bytes.
mkdir -p "$WORK/mpi"
SHARDTRAIN_TEST_PP_CHECKPOINT_OUT=$WORK/mpi timeout -k 5 300 $MPIRUN -np 4 -x SHARDTRAIN_TEST_PP_CHECKPOINT_OUT \
  "$MPI_TESTS" --gtest_color=no --gtest_filter='PpCheckpoint.*' >"$WORK/mpi.log" 2>&1 ||
  { tail -50 "$WORK/mpi.log"; fail "PpCheckpoint tests"; }
grep -q "PASSED  \] 4 tests" "$WORK/mpi.log" || { tail -30 "$WORK/mpi.log"; fail "PpCheckpoint: not 4 tests passed"; }
timeout -k 5 60 "$BIN" --mode inspect "$WORK/mpi/pp2_dp2.h5" >"$WORK/inspect.txt" 2>&1 || fail "inspect pp2_dp2.h5"
grep -qF "saved by a pipeline-parallel run: pp 2 (1f1b) x world size 2 per stage: cp 1 x dp_shard 2 (attributes 'mesh' and 'pipeline', chunk bounds [0, 2, 4]" "$WORK/inspect.txt" ||
  { cat "$WORK/inspect.txt"; fail "inspect: no pipeline line"; }
grep -qF "unit model.layers.2: numel 1952, shard_size 976, padded_numel 1952, stage 1" "$WORK/inspect.txt" ||
  { grep unit "$WORK/inspect.txt"; fail "inspect: no stage of model.layers.2"; }
for f in pp1_dp4 pp2_dp2 pp2_tp2 pp2v2_dp2 pp2_tp2:3; do  # at 1 rank, and pp2_tp2 at 3 too
  np=1
  [[ $f == *:* ]] && { np=${f#*:}; f=${f%:*}; }
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" --mode export --checkpoint "$WORK/mpi/$f.h5" --out "$WORK/hf-$f-$np" \
    >"$WORK/export-$f-$np.log" 2>&1 || { cat "$WORK/export-$f-$np.log"; fail "export of $f.h5 at $np ranks"; }
  cmp -s "$WORK/hf-pp1_dp4-1/model.safetensors" "$WORK/hf-$f-$np/model.safetensors" ||
    fail "export of $f.h5 at $np ranks differs from the pp 1 file's"
done
echo "ok: exports of the pp 2 x dp 2, pp 2 x tp 2 (1 and 3 ranks) and interleaved files equal the pp 1 file's, byte for byte"
# ... and the trained file exports at 1 and 3 ranks alike.
for np in 1 3; do
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" --mode export --checkpoint "$F" --out "$WORK/hf-trained-$np" \
    >"$WORK/export-trained-$np.log" 2>&1 || { cat "$WORK/export-trained-$np.log"; fail "export of the trained file"; }
done
cmp -s "$WORK/hf-trained-1/model.safetensors" "$WORK/hf-trained-3/model.safetensors" || fail "exports at 1 and 3 ranks differ"
echo "ok: the trained pp 2 file exports to the same bytes at 1 and 3 ranks"

# 5. Crafted files, resealed (tests/e2e/ckpt_meta.py) so that only the edit is wrong.
craft() {  # NAME PYTHON-EDIT: a copy of $F with the edit applied to h5py File f, checksums recomputed
  cp "$F" "$WORK/$1.h5"
  "$PY" - "$WORK/$1.h5" "$ROOT/tests/e2e" "$2" <<'PY'
import sys
import h5py
path, here, edit = sys.argv[1:4]
sys.path.insert(0, here)
import ckpt_meta
with h5py.File(path, "r+") as f:
    exec(edit)
ckpt_meta.reseal(path)
PY
}
craft bad_bounds 'f.attrs.create("pipeline", "{\"bounds\":[0,2,5],\"pp\":2,\"schedule\":\"1f1b\",\"virtual\":1}", dtype=h5py.string_dtype("utf-8"))'
expect_fail bad_bounds "checkpoint '$WORK/bad_bounds.h5': attribute 'pipeline' ({\"bounds\":[0,2,5],\"pp\":2,\"schedule\":\"1f1b\",\"virtual\":1}): 'bounds' ends at 5, but the model (attribute 'model_config') has 4 blocks" \
  4 "${ARGS[@]}" --pp 2 --resume "$WORK/bad_bounds.h5"
craft bad_stage 'f.attrs.create("pipeline", "{\"bounds\":[0,1,4],\"pp\":2,\"schedule\":\"1f1b\",\"virtual\":1}", dtype=h5py.string_dtype("utf-8"))'
expect_fail bad_stage "checkpoint '$WORK/bad_stage.h5': unit 'model.layers.1': attribute 'stage' is 0, but attribute 'pipeline' (bounds [0,1,4], pp 2) puts it on stage 1" \
  4 "${ARGS[@]}" --resume "$WORK/bad_stage.h5"
craft stage_range 'f["units/model.norm"].attrs.create("stage", 7, dtype="<i8")'
expect_fail stage_range "unit 'model.norm': attribute 'stage' is 7, not a stage of pp 2" 4 --mode export --checkpoint "$WORK/stage_range.h5" --out "$WORK/hf-bad"
craft bad_schedule 'f.attrs.create("pipeline", "{\"bounds\":[0,2,4],\"pp\":2,\"schedule\":\"foo\",\"virtual\":1}", dtype=h5py.string_dtype("utf-8"))'
expect_fail bad_schedule "'schedule' is not a schedule's name (gpipe, 1f1b, interleaved, zero-bubble)" 4 --mode export \
  --checkpoint "$WORK/bad_schedule.h5" --out "$WORK/hf-bad2"
echo "PASS: test_pp_checkpoint"
