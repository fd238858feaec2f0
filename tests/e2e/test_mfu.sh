#!/usr/bin/env bash
# MFU and progress on the CPU (issue 30, items 2 and 5): with each rank on cores of its own, the
# first lines give the measured CPU peak and every step line an MFU; with ranks sharing cores, "CPU
# peak not measured: cores shared" and "MFU n/a" (no number, no `mfu` in the metrics);
# --peak-tflops gives MFU = tokens/s x flops/token / (ranks x peak), checked against the printed
# line and a hand count of the model's FLOPs (PaLM: 6 N + 12 L H Q T, N without the input
# embedding lookup); step lines end "ETA h:mm:ss | N tokens", metrics rows carry tokens_seen and eta_s.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
T=32
B=4
ARGS=(--model tiny --data "$DATA" --seq-len $T --global-batch $B --steps 6 --log-every 1 --eval-every 0 --eval-batches 1
      --device cpu)
CORES=$(nproc --all 2>/dev/null || nproc)

run() {  # run NAME NP [MPIRUN OPTIONS...] -- [SHARDTRAIN OPTIONS...]: must succeed; $WORK/NAME.log, NAME.jsonl
  local name=$1 np=$2 mpi=() extra=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do mpi+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  extra=("$@")
  timeout -k 5 120 $MPIRUN "${mpi[@]}" -np "$np" "$BIN" "${ARGS[@]}" --metrics "$WORK/$name.jsonl" "${extra[@]}" \
    >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name: run failed"; }
  grep -q '^done:' "$WORK/$name.log" || { cat "$WORK/$name.log"; fail "$name: training did not finish"; }
}
steps() { grep -E '^step [0-9]+/' "$WORK/$1.log"; }

# 1. Two ranks, each bound to a core of its own (mpirun's default for 2 ranks): the measured peak in
# the first lines, an MFU on every step line, the progress tail, the metrics fields.
run own 2 --
head -n 6 "$WORK/own.log" | grep -qE '^CPU peak \(measured: sgemm 1024\^3 .* kernels, 1 thread x 2 ranks, [0-9.]+ s\): .*[0-9.]+ GFLOP/s' \
  || { cat "$WORK/own.log"; fail "own cores: no measured CPU peak in the first lines"; }
[ "$(steps own | wc -l)" -eq 6 ] || fail "own cores: expected 6 step lines"
steps own | grep -vqE '\| MFU [0-9]+\.[0-9]% \| [0-9.]+ s \| ETA ([0-9]+:[0-5][0-9]:[0-5][0-9]|n/a) \| [0-9.]+k? tokens$' \
  && { steps own; fail "own cores: a step line without MFU, ETA and tokens at its end"; }
steps own | head -1 | grep -q '| ETA n/a | 128 tokens$' || fail "own cores: step 1 should say ETA n/a, 128 tokens: $(steps own | head -1)"
steps own | tail -1 | grep -q '| ETA 0:00:00 | 768 tokens$' || fail "own cores: the last step: $(steps own | tail -1)"
python3 - "$WORK/own.jsonl" <<'PY' || fail "own cores: metrics fields"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
assert len(rows) == 6, rows
for r in rows:
    assert r["tokens_seen"] == 4 * 32 * r["step"], r
    assert 0 < r["mfu"] < 1, r
assert "eta_s" not in rows[0] and all(r["eta_s"] >= 0 for r in rows[1:]) and rows[-1]["eta_s"] == 0, rows
PY
echo "ok: own cores: $(grep -m1 '^CPU peak' "$WORK/own.log"); $(steps own | tail -1 | grep -oE 'MFU .*')"

# 2. Ranks sharing cores: 2 unbound ranks with as many threads each as the node has CPUs; and, on a
# machine with fewer than 4 CPUs, 4 ranks oversubscribed (the issue's case).
shared_case() {
  local name=$1
  grep -q '^CPU peak not measured: cores shared (rank 0: ' "$WORK/$name.log" || { cat "$WORK/$name.log"; fail "$name: no 'cores shared'"; }
  grep -q '^CPU peak (measured' "$WORK/$name.log" && fail "$name: a peak was measured"
  steps "$name" | grep -vq '| MFU n/a | ' && { steps "$name"; fail "$name: a step line with an MFU number"; }
  grep -q '"mfu"' "$WORK/$name.jsonl" && fail "$name: mfu in the metrics"
  echo "ok: $name: $(grep -m1 '^CPU peak' "$WORK/$name.log"); $(steps "$name" | tail -1 | grep -oE 'MFU n/a.*')"
}
run threads 2 --bind-to none -- --threads "$CORES"
shared_case threads
if [ "$CORES" -lt 4 ]; then
  run over 4 --oversubscribe --
  shared_case over
fi

# 3. --peak-tflops: the printed MFU is tokens/s x flops/token / (ranks x peak), flops/token by hand
# from the model's config.json (--mode plan --out), and the metrics agree to the last digit.
"$BIN" --mode plan --model tiny --seq-len $T --global-batch $B --world-size 2 --out "$WORK/tiny.json" >/dev/null
run peak 2 -- --peak-tflops 0.001
grep -q '^MFU peak: --peak-tflops 0.001 TFLOP/s per rank.s device x 2 ranks = 0.002 TFLOP/s' "$WORK/peak.log" \
  || { cat "$WORK/peak.log"; fail "peak: no --peak-tflops line"; }
grep -q '^CPU peak' "$WORK/peak.log" && fail "peak: measured although --peak-tflops was given"
python3 - "$WORK/peak.log" "$WORK/peak.jsonl" "$WORK/tiny.json" $T <<'PY' || fail "peak: MFU does not follow the formula"
import json, re, sys
log, metrics, cfg, T = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])), int(sys.argv[4])
C, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
Q = cfg.get("head_dim") or C // H
N = L * (2 * C + C * H * Q + 2 * C * KV * Q + H * Q * C + 3 * C * I) + C + V * C  # LM head; no lookup table
fpt = 6 * N + 12 * L * H * Q * T
peak = 2 * 0.001e12
n = 0
for m in re.finditer(r"\| (\d+) tok/s \|.*\| MFU ([0-9.]+)% \|", open(log).read()):
    tps, mfu = float(m.group(1)), float(m.group(2))
    want = 100 * tps * fpt / peak
    # tok/s is printed rounded to 1, MFU to 0.1
    assert abs(mfu - want) <= 0.05 + 100 * 0.5 * fpt / peak + 1e-9, (mfu, want, tps)
    n += 1
assert n == 6, n
for r in (json.loads(l) for l in open(metrics) if '"loss"' in l):
    assert abs(r["mfu"] - r["tokens_per_s"] * fpt / peak) <= 1e-9 * r["mfu"], (r, fpt)
print(f"flops/token {fpt} (N = {N}), {n} step lines checked")
PY
echo "ok: --peak-tflops 0.001 x 2 ranks: $(steps peak | tail -1 | grep -oE '[0-9]+ tok/s|MFU [0-9.]+%' | tr '\n' ' ')"

# 4. --peak-tflops refused when not a positive finite number, naming the option.
expect_fail peak-zero "option '--peak-tflops' must be > 0" 1 "${ARGS[@]}" --peak-tflops 0
expect_fail peak-nan "option '--peak-tflops' must be a finite number" 1 "${ARGS[@]}" --peak-tflops nan
expect_fail peak-huge "option '--peak-tflops' must be in [1e-6, 1e6]" 1 "${ARGS[@]}" --peak-tflops 1e300
expect_fail peak-tiny "option '--peak-tflops' must be in [1e-6, 1e6]" 1 "${ARGS[@]}" --peak-tflops 1e-300
