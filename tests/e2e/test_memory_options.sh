#!/usr/bin/env bash
# Activation checkpointing, attention kind and loss chunk end to end, and --mode plan:
#  - the same 6-step run (3 ranks, GQA, untied head) with --activation-checkpointing none, selective
#    and full ends with bitwise identical parameters (every tensor of the final checkpoint) and losses;
#  - --attention exact and --loss-chunk 5 change only rounding: losses within 1e-5 relative;
#  - a resume may change the checkpointing mode (it is not part of the checkpointed run);
#  - every training run prints the memory plan and the measured peak per rank;
#  - --mode plan: the sharded state falls as 1/W; --device-memory prints what fits; --out writes the
#    model's config.json, from which transformers builds a model of the same parameter count; bad values of
#    the new options fail on every rank, naming the option.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
cat >"$WORK/model.json" <<'J'
{"vocab_size": 258, "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 3,
 "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 64,
 "tie_word_embeddings": false, "bos_token_id": 256, "eos_token_id": 257}
J
run() {  # NAME STEPS EXTRA...
  local name=$1 steps=$2
  shift 2
  timeout -k 5 300 $MPIRUN -np 3 --bind-to none "$BIN" --model "$WORK/model.json" --data "$DATA" --seq-len 48 \
    --global-batch 6 --steps 6 --stop-at-step "$steps" --lr 3e-3 --warmup 2 --log-every 1 --eval-every 0 \
    --eval-batches 1 --threads 1 --metrics "$WORK/$name.jsonl" --checkpoint-dir "$WORK/$name.ckpt" "$@" \
    >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name: training failed"; }
}
dump() {  # NAME: every parameter of the step-6 checkpoint
  timeout -k 5 120 $MPIRUN -np 1 "$BIN" --mode inspect "$WORK/$1.ckpt/step_00000006.h5" --dump-param all \
    --dump-out "$WORK/$1.dump" >"$WORK/$1.inspect.log" 2>&1 || { cat "$WORK/$1.inspect.log"; fail "$1: inspect failed"; }
}
for m in none selective full; do
  run "$m" 6 --activation-checkpointing "$m"
  dump "$m"
done
for m in selective full; do
  diff <(losses "$WORK/none.jsonl") <(losses "$WORK/$m.jsonl") || fail "$m vs none: losses differ"
  n=0
  for f in "$WORK/none.dump"/*; do
    cmp -s "$f" "$WORK/$m.dump/$(basename "$f")" || fail "$m vs none: $(basename "$f") differs"
    n=$((n + 1))
  done
  [ "$n" -ge 20 ] || fail "only $n tensors dumped"
done
echo "ok: --activation-checkpointing none, selective, full: identical losses and $n identical tensors after 6 steps at 3 ranks"

grep -q "memory plan per rank" "$WORK/full.log" || fail "no memory plan in the training log"
grep -qE "memory: peak resident \(VmHWM\) per rank [0-9]+, [0-9]+, [0-9]+ MiB; plan [0-9]+ MiB" "$WORK/full.log" ||
  { tail -3 "$WORK/full.log"; fail "no measured peak per rank at the end of the run"; }
echo "ok: the run logs its plan and $(grep -o 'peak resident.*' "$WORK/full.log")"

run exact 6 --attention exact
run chunk5 6 --loss-chunk 5
"$PY" - "$WORK/none.jsonl" "$WORK/exact.jsonl" "$WORK/chunk5.jsonl" <<'P' || fail "attention / loss chunk changed the losses"
import json, sys
ls = [[json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in sys.argv[1:]]
for name, other in zip(["exact", "chunk5"], ls[1:]):
    worst = max(abs(a - b) / abs(a) for a, b in zip(ls[0], other))
    assert len(other) == 6 and worst < 1e-5, (name, worst)
    print(f"ok: {name} vs tiled/default chunk: worst relative loss difference {worst:.2e} over 6 steps")
P

# A run checkpointed at step 3 with `none`, resumed with `full`: the losses of the uninterrupted run.
run switch 3 --activation-checkpointing none
run switch 6 --activation-checkpointing full --resume auto
diff <(losses "$WORK/none.jsonl") <(losses "$WORK/switch.jsonl") || fail "resume with another checkpointing mode changed the losses"
echo "ok: resume at step 3 with another --activation-checkpointing mode: the same 6 losses"

# --mode plan.
plan() { timeout -k 5 60 "$BIN" --mode plan --model llama-8b --device cuda --precision bf16 --seq-len 2048 --micro-batch 1 "$@" 2>&1; }
s1=$(plan --world-size 8 | sed -n 's/^ *\([0-9.]*\) MiB  fp32 parameter shards.*/\1/p')
s2=$(plan --world-size 64 | sed -n 's/^ *\([0-9.]*\) MiB  fp32 parameter shards.*/\1/p')
"$PY" -c "import sys; a, b = float('$s1'), float('$s2'); assert abs(a / b - 8) < 0.01, (a, b)" ||
  fail "parameter shards at W=8 ($s1 MiB) are not 8x those at W=64 ($s2 MiB)"
# 8,030,261,248 parameters: 4 bytes each over 64 ranks, in MiB (padding adds at most one element per unit).
"$PY" -c "assert abs(float('$s2') - 8030261248 * 4 / 64 / 2**20) < 0.2" || fail "W=64 parameter shards $s2 MiB"
out=$(plan --world-size 8 --device-memory 80GB)
for mode in none selective full; do
  grep -qE -- "--activation-checkpointing $mode: (micro-batch up to [0-9]+|does not fit)" <<<"$out" ||
    { echo "$out"; fail "plan --device-memory lacks the $mode line"; }
done
echo "ok: --mode plan: parameter shards $s1 MiB at W=8, $s2 MiB at W=64; fits: $(grep -o 'full: .*' <<<"$out")"
# Mixture of experts under --ep: each mode's line also gives what fits at the worst routing
# imbalance, K such that the plan's own worst-case total at micro-batch K is within the budget and at
# K + 1 is not (read from the plan printed at those micro-batches).
moe_plan() { timeout -k 5 60 "$BIN" --mode plan --model "$ROOT/tests/bench/moe-config.json" --seq-len 256 --world-size 4 --ep 2 "$@" 2>&1; }
out=$(moe_plan --device-memory 1GiB)
k=$(sed -n 's/.*checkpointing none: micro-batch up to [0-9]* (up to \([0-9]*\) at the worst routing imbalance).*/\1/p' <<<"$out")
[ -n "$k" ] || { echo "$out"; fail "plan --device-memory with --ep: no worst-imbalance figure"; }
worst() { moe_plan --micro-batch "$1" | sed -n 's/^ *\([0-9.]*\) MiB  total per rank at the worst routing imbalance.*/\1/p'; }
a=$(worst "$k"); b=$(worst $((k + 1)))
"$PY" -c "assert float('$a') <= 1024 < float('$b'), ('$a', '$b')" ||
  fail "worst-imbalance fit $k: plan totals $a MiB at $k, $b MiB at $((k + 1)) against 1024 MiB"
if plan --world-size 8 --device-memory 80GB | grep -q "worst routing imbalance"; then fail "a dense model's plan speaks of routing"; fi
echo "ok: --mode plan --ep 2 --device-memory 1GiB: micro-batch up to $k at the worst routing imbalance ($a MiB; $b MiB at $((k + 1)))"

# --mode plan --out: the resolved model as config.json (what tests/gpu/peer.py builds PyTorch's model
# from). transformers' LlamaForCausalLM from it must have exactly shardtrain's parameter count.
out=$(timeout -k 5 60 $MPIRUN -np 2 "$BIN" --mode plan --model llama-350m --out "$WORK/plan-config.json" 2>&1) ||
  { echo "$out"; fail "--mode plan --out failed"; }
n=$(sed -n "s/.*'llama-350m' (\([0-9]*\) parameters).*/\1/p" <<<"$out" | head -1)
"$PY" - "$WORK/plan-config.json" "$n" <<'PY' || fail "--mode plan --out: config.json does not give shardtrain's model"
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = json.load(open(sys.argv[1]))
with torch.device("meta"):
    m = LlamaForCausalLM(LlamaConfig(**cfg))
got = sum(p.numel() for p in m.parameters())
assert got == int(sys.argv[2]), (got, sys.argv[2])
assert cfg["num_hidden_layers"] == 24 and cfg["hidden_size"] == 1024, cfg
print(f"ok: --mode plan --out: transformers builds llama-350m from it with {got:,} parameters, as shardtrain")
PY
expect_fail bad_plan_out "option '--out': cannot write the model's config.json" 2 --mode plan --model tiny \
  --out "$WORK/no-such-dir/config.json"

expect_fail bad_ckpt "option '--activation-checkpointing' must be none, selective or full" 2 --model tiny --data "$DATA" --activation-checkpointing foo
expect_fail bad_attention "option '--attention' must be tiled or exact" 2 --model tiny --data "$DATA" --attention flash
expect_fail bad_chunk "option '--loss-chunk' must be >= 0" 2 --model tiny --data "$DATA" --loss-chunk -1
expect_fail bad_devmem "option '--device-memory'" 2 --mode plan --model tiny --device-memory 80XB
expect_fail bare_devmem "option '--device-memory' needs a unit, e.g. 80GB or 139GiB, got '80'" 2 --mode plan --model tiny --device-memory 80
expect_fail bad_world "option '--world-size'" 2 --mode plan --model tiny --world-size -3
echo "ok: bad values fail on every rank naming the option"
