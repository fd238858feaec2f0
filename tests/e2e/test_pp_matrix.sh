#!/usr/bin/env bash
# The whole pipeline matrix of issue 42 (make test-pp-matrix; make test runs the subset in
# test_pipeline.sh). fp32 models of 8 blocks (GQA), tied and untied, T 32, global batch 8 in
# micro-batches of 1, 20 steps; every step's loss within 1e-5 relative, grad norm within 1e-4 and the
# final val_loss within 1e-5 of the single-stage run at one rank (bf16: of the single-stage bf16 run,
# within 2e-2, the project's bf16 tolerance):
#   pp 2 and pp 4, each of gpipe, 1f1b, interleaved (--pp-virtual 2; pp 4 x v 2 = 8 chunks of one
#   block), zero-bubble; pp 2 x dp 2; pp 2 x tp 2; pp 2 x tp 2 x cp 2 (8 ranks, oversubscribed);
#   pp 2 under --activation-checkpointing selective and full (against the single-stage run in the
#   same mode); bf16 at pp 2 (1f1b, zero-bubble); tied and untied each.
# Prints one line per run; the closing note of issue 42 quotes them.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
mk() {  # file tied
  cat >"$1" <<J
{"architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 64, "intermediate_size": 96,
 "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
 "tie_word_embeddings": $2, "bos_token_id": 256, "eos_token_id": 257, "rope_theta": 10000.0, "initializer_range": 0.1}
J
}
TRAIN=(--data "$DATA" --seq-len 32 --global-batch 8 --micro-batch 1 --steps 20 --lr 3e-3 --warmup 2 --eval-every 0
       --eval-batches 1 --log-every 1 --threads 1 --device cpu)
run() {  # name np args...
  local name=$1 np=$2
  shift 2
  timeout -k 5 300 $MPIRUN -np "$np" "$BIN" "${TRAIN[@]}" --metrics "$WORK/$name.jsonl" "$@" >"$WORK/$name.log" 2>&1 \
    || { cat "$WORK/$name.log"; fail "$name: training failed"; }
}
compare() {  # REF NAME TOL
  "$PY" - "$WORK/$1.jsonl" "$WORK/$2.jsonl" "$2" "$3" <<'P' || fail "$2 differs from $1"
import json, sys
def read(p):
    steps, val = {}, None
    for line in open(p):
        r = json.loads(line)
        if "loss" in r: steps[r["step"]] = (r["loss"], r["grad_norm"])
        if "val_loss" in r: val = r["val_loss"]
    return steps, val
(a, va), (b, vb) = read(sys.argv[1]), read(sys.argv[2])
tol = float(sys.argv[4])
assert sorted(a) == sorted(b) and a
wl = max(abs(b[s][0] - a[s][0]) / abs(a[s][0]) for s in a)
wg = max(abs(b[s][1] - a[s][1]) / abs(a[s][1]) for s in a)
wv = abs(vb - va) / abs(va)
print(f"ok: {sys.argv[3]:34s} loss {wl:.1e}  grad_norm {wg:.1e}  val_loss {wv:.1e}  (limit {tol:g})")
sys.exit(0 if wl <= tol and wg <= 10 * tol and wv <= tol else 1)
P
}
for tied in true false; do
  t=$([ $tied = true ] && echo tied || echo untied)
  mk "$WORK/$t.json" $tied
  M=(--model "$WORK/$t.json")
  run "$t-ref" 1 "${M[@]}"
  for P in 2 4; do
    for s in gpipe 1f1b interleaved zero-bubble; do
      v=(); [ $s = interleaved ] && v=(--pp-virtual 2)
      run "$t-pp$P-$s" $P "${M[@]}" --pp $P --pp-schedule $s "${v[@]}"
      compare "$t-ref" "$t-pp$P-$s" 1e-5
    done
  done
  run "$t-pp2-dp2" 4 "${M[@]}" --pp 2
  compare "$t-ref" "$t-pp2-dp2" 1e-5
  run "$t-pp2-tp2" 4 "${M[@]}" --pp 2 --tp 2
  compare "$t-ref" "$t-pp2-tp2" 1e-5
  run "$t-pp2-tp2-cp2" 8 "${M[@]}" --pp 2 --tp 2 --cp 2
  compare "$t-ref" "$t-pp2-tp2-cp2" 1e-5
  for ac in selective full; do
    run "$t-ref-$ac" 1 "${M[@]}" --activation-checkpointing $ac
    run "$t-pp2-$ac" 2 "${M[@]}" --pp 2 --activation-checkpointing $ac
    compare "$t-ref-$ac" "$t-pp2-$ac" 1e-5
  done
  run "$t-ref-bf16" 1 "${M[@]}" --precision bf16
  for s in 1f1b zero-bubble; do
    run "$t-pp2-$s-bf16" 2 "${M[@]}" --pp 2 --pp-schedule $s --precision bf16
    compare "$t-ref-bf16" "$t-pp2-$s-bf16" 2e-2
  done
done
echo "PASS"
