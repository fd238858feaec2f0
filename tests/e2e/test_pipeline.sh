#!/usr/bin/env bash
# --pp P trains (issue 42): the make-test subset of the pipeline matrix (the whole matrix:
# tests/e2e/test_pp_matrix.sh, make test-pp-matrix). A fp32 model of 4 blocks (tied, GQA), T 32,
# global batch 8 in micro-batches of 1, 6 steps, metrics every step; against the single-stage run at
# one rank, every step's loss within 1e-5 relative, grad norm within 1e-4 and the final val_loss
# (evaluation runs through the schedule's forwards) within 1e-5:
#   pp 2 with each schedule: gpipe, 1f1b, interleaved (--pp-virtual 2), zero-bubble; pp 2 x dp 2
#   (1f1b, 4 ranks); untied, pp 2 1f1b: bitwise the single-stage losses; --clip 0.05 (clipping
#   active at every step: the global norm scales every stage's update alike); 1f1b and interleaved in
#   the NCCL order over MPI (SHARDTRAIN_TEST_PP_GROUPED=1): bitwise the losses of the same runs ungrouped.
# Each PP run's step line shows 'pp comm' and 'pp bubble', and its metrics pp_bytes > 0, the
# measured, simulated and ideal bubble per stage. Refusals, on every rank, no hang: more chunks than
# blocks, --pp-layers not summing to the blocks, --pp not dividing the world size, interleaved with
# micro-batches not a multiple of the stages, --pp-virtual without interleaved, --pp-layers without
# --pp, a --shard-group-size not dividing a stage's ranks, SHARDTRAIN_TEST_PP_GROUPED=1 on one rank of two. A resume: pp 2 x dp 2
# saved at step 3 and continued at pp 1 x dp 4 gives the straight run's losses of steps 4-6 within
# 1e-5 (the whole checkpoint matrix: test_pp_checkpoint.sh).
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
mk() {  # file tied
  cat >"$1" <<J
{"architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 64, "intermediate_size": 96,
 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
 "tie_word_embeddings": $2, "bos_token_id": 256, "eos_token_id": 257, "rope_theta": 10000.0, "initializer_range": 0.1}
J
}
mk "$WORK/tied.json" true
mk "$WORK/untied.json" false
TRAIN=(--data "$DATA" --seq-len 32 --global-batch 8 --micro-batch 1 --steps 6 --lr 3e-3 --warmup 0 --eval-every 0
       --eval-batches 1 --log-every 1 --threads 1 --device cpu)
run() {  # name np args...: a training run with metrics in $WORK/name.jsonl
  local name=$1 np=$2
  shift 2
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" "${TRAIN[@]}" --metrics "$WORK/$name.jsonl" "$@" >"$WORK/$name.log" 2>&1 \
    || { cat "$WORK/$name.log"; fail "$name: training failed"; }
}
# compare REF NAME [bitwise]: losses (1e-5; bitwise: equal), grad norms (1e-4), final val_loss (1e-5);
# for a PP run also its pp metrics.
compare() {
  "$PY" - "$WORK/$1.jsonl" "$WORK/$2.jsonl" "$2" "${3:-}" <<'P' || fail "$2 differs from $1"
import json, sys
def read(p):
    steps, val, last = {}, None, {}
    for line in open(p):
        r = json.loads(line)
        if "loss" in r: steps[r["step"]] = (r["loss"], r["grad_norm"]); last = r
        if "val_loss" in r: val = r["val_loss"]
    return steps, val, last
(a, va, _), (b, vb, lb) = read(sys.argv[1]), read(sys.argv[2])
assert sorted(a) == sorted(b) and a, (sorted(a), sorted(b))
wl = max(abs(b[s][0] - a[s][0]) / abs(a[s][0]) for s in a)
wg = max(abs(b[s][1] - a[s][1]) / abs(a[s][1]) for s in a)
wv = abs(vb - va) / abs(va)
ok = wl <= 1e-5 and wg <= 1e-4 and wv <= 1e-5
if sys.argv[4] == "bitwise": ok = ok and all(b[s][0] == a[s][0] for s in a)
pp = ""
if "pp_bytes" in lb:
    stages = len(lb["pp_bubble"])
    ok = ok and lb["pp_bytes"] > 0 and stages >= 2 and len(lb.get("pp_bubble_simulated", [])) == stages \
        and all(0 <= x <= 1 for x in lb["pp_bubble"]) and 0 < lb["pp_bubble_ideal"] < 1
    pp = (f", pp_bytes/step {lb['pp_bytes']:.0f}, bubble measured {lb['pp_bubble']} simulated "
          f"{[round(x, 3) for x in lb['pp_bubble_simulated']]} ideal {lb['pp_bubble_ideal']:.3f}")
print(f"ok: {sys.argv[3]}: loss rel diff <= {wl:.1e}, grad_norm <= {wg:.1e}, val_loss {wv:.1e}{pp}")
sys.exit(0 if ok else 1)
P
}
pp_line() {  # name: the step line shows the pipeline's communication and bubble
  grep -q "| pp comm .* | pp bubble " "$WORK/$1.log" || { cat "$WORK/$1.log"; fail "$1: no 'pp comm ... pp bubble' in the step line"; }
}

run ref 1 --model "$WORK/tied.json"
for s in gpipe 1f1b interleaved zero-bubble; do
  v=(); [ $s = interleaved ] && v=(--pp-virtual 2)
  run "pp2-$s" 2 --model "$WORK/tied.json" --pp 2 --pp-schedule $s "${v[@]}"
  compare ref "pp2-$s"
  pp_line "pp2-$s"
done
# The NCCL order (grouped transfers, one tag: pipeline.h) over MPI through the whole trainer
# (SHARDTRAIN_TEST_PP_GROUPED=1): 1F1B one slot per action, interleaved (m 8 > p 2) a forward and the
# next backward per slot; the same arithmetic, so bitwise the losses of the runs above.
for s in 1f1b interleaved; do
  v=(); [ $s = interleaved ] && v=(--pp-virtual 2)
  SHARDTRAIN_TEST_PP_GROUPED=1 run "pp2-$s-grouped" 2 --model "$WORK/tied.json" --pp 2 --pp-schedule $s "${v[@]}"
  compare "pp2-$s" "pp2-$s-grouped" bitwise
  want="pipeline: transfers grouped (stream-ordered Comm order): training per action, evaluation per action"
  [ $s = interleaved ] && want="pipeline: transfers grouped (stream-ordered Comm order): training per pair, evaluation per action"
  grep -qF "$want" "$WORK/pp2-$s-grouped.log" || { cat "$WORK/pp2-$s-grouped.log"; fail "pp2-$s-grouped: no '$want'"; }
done
run pp2-dp2 4 --model "$WORK/tied.json" --pp 2
compare ref pp2-dp2
# Saved at pp 2 x dp 2 (format version 6), resumed at pp 1 x dp 4.
run pp2-dp2-save 4 --model "$WORK/tied.json" --pp 2 --checkpoint-dir "$WORK/ck" --checkpoint-every 3 --stop-at-step 3
run pp1-resumed 4 --model "$WORK/tied.json" --checkpoint-dir "$WORK/ck" --resume auto
"$PY" - "$WORK/ref.jsonl" "$WORK/pp1-resumed.jsonl" <<'P' || fail "the resume at pp 1 x dp 4 differs from the straight run"
import json, sys
a = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r}
b = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[2])) if "loss" in r}
assert sorted(b) == [4, 5, 6], sorted(b)
w = max(abs(b[s] - a[s]) / abs(a[s]) for s in b)
print(f"ok: pp 2 x dp 2 saved at step 3, resumed at pp 1 x dp 4: steps 4-6 loss rel diff <= {w:.1e}")
sys.exit(0 if w <= 1e-5 else 1)
P
# Clipping active at every step (grad norm > 0.05): the norm is global over the stages, so the clipped
# update and every later loss are the single-stage run's.
run ref-clip 1 --model "$WORK/tied.json" --clip 0.05
run pp2-clip 2 --model "$WORK/tied.json" --pp 2 --clip 0.05
compare ref-clip pp2-clip
"$PY" -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if '\"loss\"' in l]; sys.exit(0 if all(x['grad_norm'] > 0.05 for x in r) else 1)" \
  "$WORK/pp2-clip.jsonl" || fail "pp2-clip: clipping was not active at every step"
run ref-untied 1 --model "$WORK/untied.json"
run pp2-untied 2 --model "$WORK/untied.json" --pp 2
compare ref-untied pp2-untied bitwise

M=(--model "$WORK/tied.json" "${TRAIN[@]}")
expect_fail pp-too-many-chunks "8 model chunks for 4 transformer blocks" 2 "${M[@]}" --pp 2 --pp-schedule interleaved --pp-virtual 4
expect_fail pp-layers-sum "--pp-layers" 2 "${M[@]}" --pp 2 --pp-layers 1,2
expect_fail pp-not-dividing "'--pp' (3) does not divide the world size (2)" 2 "${M[@]}" --pp 3
expect_fail pp-interleaved-m "3 micro-batches per step is not a multiple of --pp 2" 2 --model "$WORK/tied.json" \
  --data "$DATA" --seq-len 32 --global-batch 3 --micro-batch 1 --steps 2 --device cpu --threads 1 --pp 2 \
  --pp-schedule interleaved --pp-virtual 2
expect_fail pp-layers-alone "option '--pp-layers' needs '--pp' P > 1" 2 "${M[@]}" --pp-layers 2,2
expect_fail pp-sgs-stage "option '--shard-group-size' (4) does not divide the ranks of a pipeline stage (2 = world size 4 / '--pp' 2)" \
  4 "${M[@]}" --pp 2 --shard-group-size 4
# The test hook on some ranks only: refused on every rank (it would otherwise wait for the timeout).
rc=0
timeout -k 5 60 $MPIRUN -np 1 "$BIN" "${M[@]}" --pp 2 : -np 1 -x SHARDTRAIN_TEST_PP_GROUPED=1 "$BIN" "${M[@]}" --pp 2 \
  >"$WORK/pp-grouped-some.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$(grep -c 'error \[rank [01]/2\]: the ranks disagree on whether the pipeline' \
  "$WORK/pp-grouped-some.log")" = 2 ] || { cat "$WORK/pp-grouped-some.log"; fail "the hook on one rank of two: not refused on both (rc $rc)"; }
echo "ok: pp-grouped-some -> $(grep -m1 'error \[rank 0' "$WORK/pp-grouped-some.log" | cut -c1-160)"
expect_fail pp-virtual-alone "'--pp-virtual' (2) needs '--pp-schedule interleaved'" 2 "${M[@]}" --pp 2 --pp-virtual 2
echo "PASS"
