#!/usr/bin/env bash
# Threads inside a rank do not change the result: the same 8-step training run with 1 and with 3
# threads per rank (world size 1, unbound) and with 1 and 2 threads per rank (world size 2) must
# end with bitwise identical parameters (every tensor of the final checkpoint, gathered with
# --mode inspect --dump-param all) and identical losses at every step. The model is
# large enough that every kernel splits its work (GEMM tiles in M and N, several row pieces).
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
cat >"$WORK/model.json" <<'J'
{"vocab_size": 258, "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 2,
 "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 64,
 "tie_word_embeddings": false, "bos_token_id": 256, "eos_token_id": 257}
J
run() {  # NAME NP THREADS
  timeout -k 5 300 $MPIRUN -np "$2" --bind-to none "$BIN" --model "$WORK/model.json" --data "$DATA" --seq-len 64 \
    --global-batch 8 --steps 8 --lr 3e-3 --warmup 2 --log-every 1 --eval-every 0 --eval-batches 1 --threads "$3" \
    --metrics "$WORK/$1.jsonl" --checkpoint-dir "$WORK/$1.ckpt" --checkpoint-every 8 >"$WORK/$1.log" 2>&1 ||
    { cat "$WORK/$1.log"; fail "$1: training failed"; }
  grep -qE "[^0-9]$3 [A-Za-z ]*thread" "$WORK/$1.log" || { head -3 "$WORK/$1.log"; fail "$1: log does not report $3 thread(s) per rank"; }
  timeout -k 5 120 $MPIRUN -np 1 "$BIN" --mode inspect "$WORK/$1.ckpt/step_00000008.h5" --dump-param all --dump-out "$WORK/$1.dump" \
    >"$WORK/$1.inspect.log" 2>&1 || { cat "$WORK/$1.inspect.log"; fail "$1: inspect failed"; }
}
compare() {  # A B
  diff <(losses "$WORK/$1.jsonl") <(losses "$WORK/$2.jsonl") || fail "$1 vs $2: losses differ"
  local n=0
  for f in "$WORK/$1.dump"/*; do
    cmp -s "$f" "$WORK/$2.dump/$(basename "$f")" || fail "$1 vs $2: $(basename "$f") differs"
    n=$((n + 1))
  done
  [ "$n" -ge 20 ] || fail "$1: only $n dumped tensors"
  echo "ok: $1 = $2 bitwise ($n tensors, $(losses "$WORK/$1.jsonl" | wc -l) losses)"
}
run np1-t1 1 1
run np1-t3 1 3
compare np1-t1 np1-t3
run np2-t1 2 1
run np2-t2 2 2
compare np2-t1 np2-t2
