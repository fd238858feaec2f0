#!/usr/bin/env bash
# make jobs-test: the installation checks a user runs on one node before submitting jobs, with
# `mpirun --oversubscribe` and jobs/small-test.ini on the fortunes token file (make data):
#  (a) smoke: 2 ranks train small-test's 40 steps; the loss falls (last < 0.8 x first, and the final
#      validation loss well under ln 258).
#  (b) resume: 4 ranks train to a checkpoint at step 20 and stop; 2 ranks resume it (--resume auto)
#      to step 40. The 40 losses of the metrics JSONL match an uninterrupted 4-rank run within 1e-5
#      relative (the first 20 exactly).
#  (c) export: jobs/export.sbatch (LAUNCHER=mpirun, one rank) exports the checkpoint 'latest' names
#      (step 40 of (b)); transformers loads it with no missing or unexpected weights, its tokenizer
#      gives BOS + the UTF-8 bytes of "hello", and its logits for these ids match
#      `shardtrain --mode generate CKPT --prompt hello --max-new-tokens 0 --dump-logits F` within 1e-4.
#  (d) job script: jobs/train-cpu.sbatch runs small-test for real outside Slurm (LAUNCHER=mpirun,
#      2 ranks): the real binary accepts the command the script builds, the run ends at step 40 with a
#      checkpoint; started again, the script sees the run complete and exits 0 without launching.
#  (e) preemption: the same script, 200 steps; SIGUSR1 to the batch shell (as --signal=B:USR1) after
#      step 5: the ranks save a checkpoint and exit 75, the script exits 0; started again it resumes
#      (--resume auto) and the 200 losses match an uninterrupted run within 1e-5 relative.
# Each check prints "ok" or "FAIL" (with the end of its log); the last line is
# "jobs-test: N passed, M failed"; exit status non-zero iff a check failed. Logs: build/jobs-test-logs/.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${BUILD:-build}
BIN=$ROOT/$BUILD/shardtrain
DATA=$ROOT/$BUILD/data/fortunes.tok
PY=$ROOT/.venv/bin/python
JOB=jobs/small-test.ini
LOGS=$ROOT/$BUILD/jobs-test-logs
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none # containers often forbid CMA (ptrace)
MPIRUN=(mpirun --oversubscribe)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardtrain-jobs-test.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$LOGS"

# train LOG NP ARGS...: small-test at NP ranks from the repository root (the job file's data path is
# relative to it), one loss per step in the metrics file.
train() {
  local log=$1 np=$2
  shift 2
  timeout -k 5 120 "${MPIRUN[@]}" -np "$np" "$BIN" --config "$JOB" --log-every 1 "$@" >"$WORK/$log" 2>&1 ||
    { cat "$WORK/$log"; echo "training ($log, $np ranks) failed"; return 1; }
}

check_smoke() {
  train a.log 2 --checkpoint-dir "$WORK/a" --metrics "$WORK/a.jsonl"
  "$PY" - "$WORK/a.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
loss = [r["loss"] for r in rows if "loss" in r]
val = [r["val_loss"] for r in rows if "val_loss" in r]
assert len(loss) == 40, f"{len(loss)} losses, expected 40"
assert all(math.isfinite(x) for x in loss), "non-finite loss"
assert loss[-1] < 0.8 * loss[0], f"loss did not fall: {loss[0]:.4f} -> {loss[-1]:.4f}"
assert val and val[-1] < math.log(258) - 1.0, f"final val_loss {val[-1] if val else None} not below ln(258) - 1"
print(f"2 ranks, 40 steps: loss {loss[0]:.4f} -> {loss[-1]:.4f}, val_loss {val[-1]:.4f} (ln 258 = {math.log(258):.4f})")
PY
}

check_resume() {
  train ref.log 4 --checkpoint-dir "$WORK/ref" --metrics "$WORK/ref.jsonl"
  train b1.log 4 --checkpoint-dir "$WORK/b" --metrics "$WORK/b.jsonl" --stop-at-step 20
  [ "$(cat "$WORK/b/latest")" = step_00000020.h5 ] || { echo "4-rank run did not stop with a checkpoint at step 20"; return 1; }
  train b2.log 2 --checkpoint-dir "$WORK/b" --metrics "$WORK/b.jsonl" --resume auto
  grep -q "resumed from '$WORK/b/step_00000020.h5' at step 20 (saved at world size 4)" "$WORK/b2.log" ||
    { cat "$WORK/b2.log"; echo "2-rank run did not resume the 4-rank checkpoint at step 20"; return 1; }
  [ "$(cat "$WORK/b/latest")" = step_00000040.h5 ] || { echo "resumed run did not save step 40"; return 1; }
  "$PY" - "$WORK/ref.jsonl" "$WORK/b.jsonl" <<'PY'
import json, sys
ref, got = ([json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in sys.argv[1:3])
assert len(ref) == len(got) == 40, (len(ref), len(got))
assert ref[:20] == got[:20], "steps 1-20 at 4 ranks differ from the uninterrupted 4-rank run"
worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
assert worst <= 1e-5, f"resumed losses deviate from the uninterrupted run: worst relative difference {worst:.2e}"
print(f"4 ranks to step 20, resumed at 2 ranks to 40: 40 losses within {worst:.1e} relative of the uninterrupted run "
      f"({ref[19]:.4f} at step 20, {got[-1]:.4f} at 40)")
PY
}

check_export() {
  local ck=$WORK/b
  [ -f "$ck/latest" ] || { echo "no checkpoint from the resume check"; return 1; }
  local want
  want=$ck/$(cat "$ck/latest")
  LAUNCHER=mpirun MPIRUN_ARGS=--oversubscribe SHARDTRAIN_BIN="$BIN" CKPT_DIR="$ck" EXPORT_DIR="$WORK/hf" \
    timeout -k 5 120 bash jobs/export.sbatch "$JOB" >"$WORK/export.log" 2>&1 || { cat "$WORK/export.log"; echo "export failed"; return 1; }
  grep -qF "from '$want' at world size 1" "$WORK/export.log" || { cat "$WORK/export.log"; echo "did not export $want at world size 1"; return 1; }
  timeout -k 5 60 "$BIN" --mode generate "$want" --prompt hello --max-new-tokens 0 --dump-logits "$WORK/logits.bin" \
    >"$WORK/generate.log" 2>&1 || { cat "$WORK/generate.log"; echo "generate --dump-logits failed"; return 1; }
  timeout -k 5 120 "$PY" - "$WORK/hf" "$WORK/logits.bin" "$(basename "$want")" <<'PY'
import os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
transformers.logging.disable_progress_bar()
torch.set_num_threads(2)
d, dump, name = sys.argv[1:4]
model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
bad = {k: v for k, v in info.items() if v}
assert not bad, f"transformers loading info: {bad}"
tok = AutoTokenizer.from_pretrained(d)
ids = tok("hello")["input_ids"]
assert ids == [256] + list(b"hello"), ids  # BOS + the prompt's bytes, as shardtrain's --dump-logits
V = model.config.vocab_size
mine = np.fromfile(dump, dtype="<f4")
assert mine.size == len(ids) * V, f"dump holds {mine.size} floats, expected {len(ids)} x {V}"
mine = torch.from_numpy(mine.reshape(len(ids), V))
with torch.no_grad():
    theirs = model(torch.tensor([ids])).logits[0].float()
diff = (theirs - mine).abs().max().item()
assert diff <= 1e-4, f"max |logit difference| {diff:.3e} > 1e-4"
assert (mine.max(1).values - mine.min(1).values).min().item() > 1e-2, "logits nearly constant: the comparison says nothing"
print(f"export of {name} loads in transformers (no missing/unexpected keys); logits [{len(ids)}, {V}] of BOS + 'hello' "
      f"match shardtrain's within {diff:.1e}")
PY
}

check_job_script() {
  local sub=$WORK/submit
  mkdir -p "$sub/build/data"
  ln -sf "$DATA" "$sub/build/data/fortunes.tok"  # the job file's data path, relative to the submit directory
  # From a submit directory of its own (checkpoints/ and metrics land there), as sbatch would start it.
  (cd "$sub" && LAUNCHER=mpirun SLURM_NTASKS=2 MPIRUN_ARGS=--oversubscribe SHARDTRAIN_BIN="$BIN" \
    timeout -k 5 120 bash "$ROOT/jobs/train-cpu.sbatch" "$ROOT/$JOB") >"$WORK/d1.log" 2>&1 ||
    { cat "$WORK/d1.log"; echo "jobs/train-cpu.sbatch failed"; return 1; }
  { grep -q "^shardtrain: 2 ranks" "$WORK/d1.log" && grep -q "training finished" "$WORK/d1.log"; } ||
    { cat "$WORK/d1.log"; echo "the script did not run 2 ranks to the end"; return 1; }
  { [ "$(cat "$sub/checkpoints/small-test/latest")" = step_00000040.h5 ] && [ -s "$sub/checkpoints/small-test/metrics.jsonl" ]; } ||
    { ls -R "$sub/checkpoints"; echo "no step-40 checkpoint or metrics in checkpoints/small-test"; return 1; }
  (cd "$sub" && LAUNCHER=mpirun SLURM_NTASKS=2 MPIRUN_ARGS=--oversubscribe SHARDTRAIN_BIN="$BIN" \
    timeout -k 5 60 bash "$ROOT/jobs/train-cpu.sbatch" "$ROOT/$JOB") >"$WORK/d2.log" 2>&1 ||
    { cat "$WORK/d2.log"; echo "second start failed"; return 1; }
  { grep -q "training is complete, nothing to run" "$WORK/d2.log" && ! grep -q "^shardtrain:" "$WORK/d2.log"; } ||
    { cat "$WORK/d2.log"; echo "second start did not see the run complete"; return 1; }
  echo "jobs/train-cpu.sbatch (LAUNCHER=mpirun, 2 ranks): $(grep -m1 '^done:' "$WORK/d1.log"); started again: $(tail -1 "$WORK/d2.log")"
}

check_preempt() {
  local sub=$WORK/preempt m i
  mkdir -p "$sub/build/data"
  ln -sf "$DATA" "$sub/build/data/fortunes.tok"
  m=$sub/checkpoints/small-test/metrics.jsonl
  local args=("$ROOT/$JOB" --steps 200 --log-every 1)
  train ref200.log 2 --steps 200 --checkpoint-dir "$WORK/ref200" --metrics "$WORK/ref200.jsonl"
  # As under sbatch --signal=B:USR1@120: the warning goes to the batch shell, which forwards it.
  (cd "$sub" && exec env LAUNCHER=mpirun SLURM_NTASKS=2 MPIRUN_ARGS=--oversubscribe SHARDTRAIN_BIN="$BIN" \
    bash "$ROOT/jobs/train-cpu.sbatch" "${args[@]}") >"$WORK/e1.log" 2>&1 &
  local spid=$!
  for ((i = 0; i < 600; i++)); do
    [ -f "$m" ] && [ "$(grep -c '"loss"' "$m")" -ge 5 ] && break
    sleep 0.1
  done
  kill -USR1 "$spid"
  local rc=0
  wait "$spid" || rc=$?
  { [ "$rc" -eq 0 ] && grep -q "preempted (exit status 75)" "$WORK/e1.log"; } ||
    { cat "$WORK/e1.log"; echo "SIGUSR1 to the job script: status $rc, no 'preempted (exit status 75)'"; return 1; }
  local k
  k=$(sed -n 's/^step_0*\([0-9]*\)\.h5$/\1/p' "$sub/checkpoints/small-test/latest")
  { [ -n "$k" ] && [ "$k" -ge 5 ] && [ "$k" -lt 200 ]; } || { cat "$WORK/e1.log"; echo "no checkpoint between steps 5 and 199"; return 1; }
  (cd "$sub" && LAUNCHER=mpirun SLURM_NTASKS=2 MPIRUN_ARGS=--oversubscribe SHARDTRAIN_BIN="$BIN" \
    timeout -k 5 120 bash "$ROOT/jobs/train-cpu.sbatch" "${args[@]}") >"$WORK/e2.log" 2>&1 ||
    { cat "$WORK/e2.log"; echo "second start failed"; return 1; }
  grep -q "resumed from 'checkpoints/small-test/step_0*$k.h5' at step $k" "$WORK/e2.log" ||
    { cat "$WORK/e2.log"; echo "second start did not resume step $k"; return 1; }
  "$PY" - "$WORK/ref200.jsonl" "$m" "$k" <<'PY'
import json, sys
ref, got = ([json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in sys.argv[1:3])
assert len(ref) == len(got) == 200, (len(ref), len(got))
worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
assert worst <= 1e-5, f"the preempted and resumed run deviates: worst relative difference {worst:.2e}"
print(f"SIGUSR1 to jobs/train-cpu.sbatch at step {sys.argv[3]}: checkpoint, exit 75 -> script exit 0; started again it "
      f"resumed; 200 losses {'bitwise equal to' if ref == got else f'within {worst:.1e} of'} the uninterrupted run")
PY
}

pass=0
failed=0
t_all=$SECONDS
echo "jobs-test: installation checks with $JOB ($(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) cores)"
for need in "$BIN" "$DATA" "$PY"; do
  [ -e "$need" ] || { echo "FAIL  missing $need (make build data venv)"; echo "jobs-test: 0 passed, 1 failed"; exit 1; }
done
for c in smoke resume export job_script preempt; do
  t0=$SECONDS
  (
    set -e
    "check_$c"
  ) >"$LOGS/$c.log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then
    pass=$((pass + 1))
    printf 'ok    %-11s %3ds  %s\n' "$c" $((SECONDS - t0)) "$(tail -1 "$LOGS/$c.log")"
  else
    failed=$((failed + 1))
    printf 'FAIL  %-11s %3ds  (log %s)\n' "$c" $((SECONDS - t0)) "$LOGS/$c.log"
    tail -n 25 "$LOGS/$c.log" | sed 's/^/      /'
  fi
done
echo "($((SECONDS - t_all)) s; logs in $LOGS)"
echo "jobs-test: $pass passed, $failed failed"
[ "$failed" -eq 0 ]
