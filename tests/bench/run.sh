#!/usr/bin/env bash
# make bench: training throughput and quality benchmarks. Results go to build/bench/ and are
# summarised on stdout for docs/benchmarks.md. Not part of make test (timings are not asserted).
# An estimated 85-90 minutes on an idle 2-core machine (part 2's long-context cases about 20: 12 runs of ~100 s, part 3 about 10, part 4 about 15, part 6 about 8, part 8 about 10); BENCH_QUICK=1 cuts every run to a few steps (a smoke
# test of the harness: its figures are not benchmarks).
#
# 1. tinyshakespeare quality (if ../shared/data/tinyshakespeare.txt exists; it is never
#    committed): `demo` model (4 layers, hidden 128, 4 heads), context 64, batch 12, 2000 steps,
#    AdamW lr 1e-3 (100 warm-up steps, cosine to 1e-4), beta2 0.99, weight decay 0.1, clip 1.0,
#    90/10 split; 2 ranks.
# 2. Throughput against the PyTorch peer (tests/bench/throughput.py, tests/bench/peer_torch.py):
#    shardtrain, PyTorch FSDP2 eager and torch.compile, interleaved, two rounds, on the
#    tinyshakespeare tokens (else fortunes): `demo` at 2 ranks x 1 thread and 1 rank x 2 threads,
#    a GEMM-bound config at 2 x 1; and TP 2 x 1 thread: shardtrain --tp 2 at 2 ranks against PyTorch's
#    own tensor parallelism (peer_torch.py --tp 2: parallelize_module with ColwiseParallel /
#    RowwiseParallel / SequenceParallel, torchtitan's Llama plan, gloo), the same `demo` run, batches
#    and weights (case tp2-2x1; BENCH_CASES=tp2-2x1 runs it alone). Long context (issue 41), T = 16,384,
#    global batch 2, 2 ranks: --cp 2 with each --cp-comm against plain data parallelism (cases cp2-ring,
#    cp2-gather), --attention-mask document against causal on short documents the script writes
#    (doc-vs-causal); the peer of these is the same binary with other arguments. Writes
#    build/bench/peer.md for docs/benchmarks.md.
#    Pipeline (issue 42): cases pp2-1f1b and pp2-interleaved, shardtrain --pp 2 against
#    torch.distributed.pipelining (tests/bench/peer_torch_pp.py); gemm-pp2-vs-fsdp2, shardtrain --pp 2
#    against its own FSDP 2 on the GEMM-bound config (tokens/s, fsdp_bytes, pp_bytes).
#    BENCH_BASELINE=BIN adds another shardtrain binary (e.g. an earlier commit's) to every round.
#    BENCH_BLAS_ENV=cpu drops an inherited OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE from these runs (the
#    peer's MKL ignores them; throughput.py's BLAS_ENV says why).
# 3. Checkpoint save/load timing; then asynchronous against synchronous saves of a ~99M-parameter model at
#    2 ranks, interleaved, with dd on the same disk (tests/bench/checkpoint.py, about 10 minutes with
#    the default 2 rounds; build/bench/ckpt-async.md for docs/benchmarks.md; `make bench-checkpoint`
#    runs it alone).
# 4. Memory: plan vs measured peak per rank (context parallelism's cp 1, 2, 4 at T = 16,384 included),
#    activation checkpointing modes, GPU plans (tests/bench/memory.py); then the balance of CP 4's
#    head-tail split in attention CPU time per rank (tests/e2e/test_cp_balance.sh at T = 4096).
# 5. Tokenizing throughput (MB/s of text) of --mode prepare beside Python sentencepiece and tokenizers
#    (tests/bench/prepare.py), and prepare's peak RSS on 64 MiB and 2 GiB of text.
# 6. Overlap: --overlap off / on (thread, poll, wait progress) at W = 2 and 4 (tests/bench/overlap.py),
#    about 8 minutes; `make bench-overlap` runs this part alone.
# 8. Fine-tuning on chat data (issue 55): SFT on packed v3 examples against plain training on the same
#    tokens, and shardtrain (packed; --pack none) against TRL's SFTTrainer (assistant_only_loss, one
#    process, 2 threads) on the same conversations, weights and steps, interleaved, 3 rounds unless
#    BENCH_ROUNDS says otherwise (tests/bench/sft.py; build/bench/sft.md for docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none  # containers often forbid CMA (ptrace)
BIN=build/shardtrain
OUT=build/bench
mkdir -p "$OUT"
SHAKES=${SHAKESPEARE:-../shared/data/tinyshakespeare.txt}
QUALITY_STEPS=2000 EVAL_EVERY=500 EVAL_BATCHES=100 ROUNDS=${BENCH_ROUNDS:-2} QUICK_OPT=()
if [ "${BENCH_QUICK:-0}" = 1 ]; then
  QUALITY_STEPS=40 EVAL_EVERY=20 EVAL_BATCHES=2 QUICK_OPT=(--quick)
  echo "BENCH_QUICK=1: smoke run, every run cut to a few steps; the figures below are not benchmarks"
fi
COMMON=(--model demo --seq-len 64 --global-batch 12 --lr 1e-3 --min-lr 1e-4 --warmup 100 --beta2 0.99
  --weight-decay 0.1 --clip 1.0 --seed 1337 --log-every 100)

summary() {  # name np log
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
name, np, path = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [json.loads(l) for l in open(path)]
tr = [r for r in rows if "loss" in r]
ev = [r for r in rows if "val_loss" in r]
print(f"{name}: ranks {np}, steps {tr[-1]['step']}, final train loss {tr[-1]['loss']:.4f}, "
      f"val loss {ev[-1]['val_loss']:.4f}, wall {tr[-1]['elapsed_s']:.1f} s")
PY
  grep '^done:' "$OUT/$1.log" | sed 's/^/    /'
}

echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u +%Y-%m-%d)"
make -s data >/dev/null
DATA=build/data/fortunes.tok
if [ -f "$SHAKES" ]; then
  $BIN --mode prepare --input "$SHAKES" --out "$OUT/shakespeare.tok" --val-fraction 0.1
  DATA=$OUT/shakespeare.tok
  mpirun -np 2 $BIN "${COMMON[@]}" --data "$DATA" --steps $QUALITY_STEPS --eval-every $EVAL_EVERY \
    --eval-batches $EVAL_BATCHES --metrics "$OUT/shakespeare.jsonl" >"$OUT/shakespeare.log" 2>&1
  summary shakespeare 2 "$OUT/shakespeare.jsonl"
else
  echo "tinyshakespeare: skipped ($SHAKES not found); the throughput runs use $DATA"
fi

# 2. Against the PyTorch peer: every run printed, then the ratios, then the block for
#    docs/benchmarks.md. (This replaces the former fortunes runs at 1 and 2 ranks.)
PEER_FAILED=0
rm -f "$OUT/peer.md"
python3 tests/bench/throughput.py --data "$DATA" --bin $BIN --python .venv/bin/python --out "$OUT" \
  --rounds "$ROUNDS" ${BENCH_CASES:+--cases "$BENCH_CASES"} ${BENCH_BASELINE:+--baseline "$BENCH_BASELINE"} \
  ${BENCH_BLAS_ENV:+--blas-env "$BENCH_BLAS_ENV"} \
  "${QUICK_OPT[@]}" || PEER_FAILED=1
if [ -f "$OUT/peer.md" ]; then echo "--- $OUT/peer.md:"; cat "$OUT/peer.md"; fi

# 3. Checkpoint save/load: ~10.4M parameters = 125 MB of parameters + AdamW moments, 2 ranks, next
#    to the disk's raw sequential write speed (dd with fdatasync).
cat >"$OUT/ckpt-model.json" <<'J'
{"vocab_size": 258, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 3,
 "num_attention_heads": 8, "max_position_embeddings": 64, "tie_word_embeddings": true,
 "bos_token_id": 256, "eos_token_id": 257}
J
rm -rf "$OUT/ckpt"
for i in 1 2 3; do
  mpirun -np 2 $BIN --model "$OUT/ckpt-model.json" --data build/data/fortunes.tok --seq-len 16 --global-batch 2 \
    --steps 4 --stop-at-step $i --eval-batches 1 --checkpoint-dir "$OUT/ckpt" ${RESUME:-} 2>&1 | grep -E "^(checkpoint|resumed)"
  RESUME="--resume auto"
done
dd if=/dev/zero of="$OUT/dd.bin" bs=1M count=256 conv=fdatasync 2>&1 | tail -1 | sed 's/^/dd (256 MiB, conv=fdatasync): /'
rm -f "$OUT/dd.bin"
# Asynchronous (--checkpoint-async on) against synchronous saves (issue 29 item 4): training blocked
# per save, write MB/s against dd conv=fdatasync of the same size in the same directory, and the
# step time of the steps that ran during a background write against a normal step.
CKPT_FAILED=0
python3 tests/bench/checkpoint.py --bin $BIN --data build/data/fortunes.tok --out "$OUT" --rounds "$ROUNDS" \
  "${QUICK_OPT[@]}" || CKPT_FAILED=1

# 4. Memory: the plan against the measured peak (VmHWM) of every rank, within 10%; memory and step
#    time of each --activation-checkpointing mode; GPU plans of the published shapes
#    (tests/bench/memory.py; build/bench/memory.md for docs/benchmarks.md).
MEM_FAILED=0
python3 tests/bench/memory.py $BIN build/data/fortunes.tok "$OUT" "${QUICK_OPT[@]}" || MEM_FAILED=1
# CP 4's balance (issue 41): each rank's attention CPU time (the block kernels', CPU seconds, so the
# 4 ranks sharing cores does not enter) within 10% of the mean, beside the tile counts.
CP_BALANCE_CPU_CHECK=1 CP_BALANCE_T=4096 CP_BALANCE_STEPS=4 bash tests/e2e/test_cp_balance.sh "$(dirname "$BIN")" \
  | tee "$OUT/cp-balance.txt" || MEM_FAILED=1
# 5. Tokenizing: --mode prepare with a SentencePiece model beside Python sentencepiece and Hugging Face
#    tokenizers on the same text (tinyshakespeare if present, else the fortunes), interleaved; and the
#    peak RSS of a byte-level prepare of 64 MiB and 2 GiB (tests/bench/prepare.py; build/bench/prepare.md).
PREP_TEXT=$SHAKES
[ -f "$PREP_TEXT" ] || PREP_TEXT=/usr/share/games/fortunes/fortunes
PREP_FAILED=0
.venv/bin/python tests/bench/prepare.py $BIN "$PREP_TEXT" "$OUT" "${QUICK_OPT[@]}" || PREP_FAILED=1
# 6. Overlap of communication with compute (issue 15): --overlap off against on with each
#    --comm-progress mode, W = 2 and 4, on tests/bench/scaling-config.json, interleaved
#    (tests/bench/overlap.py; build/bench/overlap.md for docs/benchmarks.md).
# 7. The pipeline bubble at p = 2 (issue 42): measured per stage against the simulated action table
#    and the formula, 1f1b / interleaved / zero-bubble / gpipe on the GEMM-bound config
#    (tests/bench/pp_bubble.py; build/bench/pp-bubble.md for docs/benchmarks.md).
PPB_FAILED=0
.venv/bin/python tests/bench/pp_bubble.py --bin $BIN --data build/data/fortunes.tok --out "$OUT/pp-bubble.md" || PPB_FAILED=1
OVL_FAILED=0
python3 tests/bench/overlap.py --bin $BIN --data build/data/fortunes.tok --out "$OUT" "${QUICK_OPT[@]}" || OVL_FAILED=1
# 8. SFT (issue 55): tokens/s of packed chat data against plain tokens; conversation tokens/s against
#    TRL's SFTTrainer (tests/bench/sft.py; build/bench/sft.md for docs/benchmarks.md).
SFT_FAILED=0
.venv/bin/python tests/bench/sft.py --bin $BIN --out "$OUT" ${BENCH_ROUNDS:+--rounds "$BENCH_ROUNDS"} "${QUICK_OPT[@]}" \
  || SFT_FAILED=1
if [ "$CKPT_FAILED" = 1 ]; then echo "bench: the checkpoint benchmark failed (see above)"; exit 1; fi
if [ "$PEER_FAILED" = 1 ]; then echo "bench: some runs against the peer failed (see above)"; exit 1; fi
if [ "$OVL_FAILED" = 1 ]; then echo "bench: the overlap benchmark failed (see above)"; exit 1; fi
if [ "$PPB_FAILED" = 1 ]; then echo "bench: the pipeline bubble is not within 20% of its simulation (see above)"; exit 1; fi
if [ "$PREP_FAILED" = 1 ]; then echo "bench: the tokenizing benchmark failed (see above)"; exit 1; fi
if [ "$MEM_FAILED" = 1 ]; then echo "bench: a memory check failed (see above)"; exit 1; fi
if [ "$SFT_FAILED" = 1 ]; then echo "bench: the SFT benchmark failed (see above)"; exit 1; fi
