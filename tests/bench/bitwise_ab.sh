#!/usr/bin/env bash
# A refactor's bitwise check against an earlier build: tests/bench/bitwise_ab.sh REF_BIN NEW_BIN [OUT]
# (tests/bench/bitwise_ab.sh --list prints the configurations). Runs the same tiny trainings with both
# binaries (model demo, T 32, global batch 12, 12 steps, validation and checkpoints at steps 6 and
# 12, seed 7, one thread per rank, mpirun --oversubscribe) and compares, exactly: every loss, grad
# norm and validation loss of the metrics files, the set of checkpoint files, and every dataset
# (dtype, shape, bytes) and attribute of every checkpoint (h5py; HDF5's own object timestamps are not
# visible to it). The 27 configurations (name: ranks, options):
#   data parallel: fp32-w2; fp32-w3-nooverlap (--overlap off); bf16-w2; bf16-w3-rbf16 (bf16 reduce);
#     hsdp-w4 (shard groups of 2); thread-w2 (--comm-progress thread); wait-w3 (wait, prefetch 2);
#   tensor parallel: tp2-fsdp2-w4; tp2-hsdp-w8 (shard groups of 4 = 2 x TP 2, 2 replicas);
#   checkpoint saves: every run above saves asynchronously (the default); save-async-w3 names
#     --checkpoint-async on, save-sync-w2 off;
#   context parallel: cp2-ring, cp2-allgather at 2 ranks; cp2-doc-ring, cp2-doc-allgather
#     (--attention-mask document) at 2 ranks on OUT/docs.tok, short documents written here
#     (fortunes.tok is one document: a plain-text file is one); cp2-fsdp2-w4 (CP 2 x FSDP 2, ring);
#     tp2-cp2-w4 (allgather); cp2-bf16-w2 (ring);
#   pipeline parallel (demo's embedding is tied: it lives on the first and the last stage, its
#     gradients summed): pp2-gpipe, pp2-1f1b, pp2-interleaved (--pp-virtual 2: 4 chunks of one
#     block), pp2-zero-bubble, each at 2 ranks in 6 micro-batches of 2; pp2-1f1b-untied (demo's shape,
#     untied, OUT/demo-untied.json); pp2-fsdp2-w4 (1f1b, 2 ranks per stage, 6 micro-batches of 1);
#     pp2-fsdp2-permb-w4 (--pp-reshard per-microbatch); pp2-zb-bf16 (zero-bubble);
#     pp2-tp2-cp2-w8 (interleaved, 12 micro-batches of 1).
# ONLY="cp2-ring pp2-1f1b" runs just the named configurations (an unknown name is refused before
# anything runs). NEW_ARGS="..." passes options to NEW_BIN only (e.g. --checkpoint-async off),
# REF_ARGS to REF_BIN only; an option given there (or by a configuration) replaces the common one of
# that name (NEW_ARGS="--seed 8" makes every configuration differ). DATA (default
# $ROOT/build/data/fortunes.tok, make data) and PY (default $ROOT/.venv/bin/python with h5py, make
# venv) can be overridden. Each run's command line, log, metrics and checkpoints: OUT/NAME-{ref,new}.
# Prints one line per configuration: "NAME: equal (...)", "NAME: DIFFERS: metrics: <the first row
# that differs> (R rows differ); checkpoints: <the first entry that differs> (N entries differ)" (or
# "checkpoints equal" / "metrics equal"), or "NAME: FAILED: ..." (a run exited non-zero; the logs'
# tails follow); then, with cp2-doc-ring, a coverage line (REF once more with the causal mask: the
# document mask must change the losses, else the check fails); then "E of N configurations equal".
# Exit 0 iff every selected configuration is equal (and the coverage holds); 2 on bad arguments.
# Time: about 7 minutes for all 27 on 2 cores shared with other jobs (420-445 s measured; one
# configuration's two runs 5-30 s, CP and PP the slowest). Not part of make test: REF_BIN is
# whatever build the change is measured against (e.g. the build before the refactor).
set -u
CONFIGS() {  # every configuration: $CB name np options...
  $CB fp32-w2 2
  $CB fp32-w3-nooverlap 3 --overlap off
  $CB bf16-w2 2 --precision bf16
  $CB bf16-w3-rbf16 3 --precision bf16 --reduce-dtype bf16
  $CB hsdp-w4 4 --shard-group-size 2
  $CB thread-w2 2 --comm-progress thread
  $CB wait-w3 3 --comm-progress wait --prefetch 2
  $CB tp2-fsdp2-w4 4 --tp 2
  $CB tp2-hsdp-w8 8 --tp 2 --shard-group-size 4
  $CB save-async-w3 3 --checkpoint-async on
  $CB save-sync-w2 2 --checkpoint-async off
  $CB cp2-ring 2 --cp 2 --cp-comm ring
  $CB cp2-allgather 2 --cp 2 --cp-comm allgather
  $CB cp2-doc-ring 2 --cp 2 --cp-comm ring --attention-mask document --data "$DOCS"
  $CB cp2-doc-allgather 2 --cp 2 --cp-comm allgather --attention-mask document --data "$DOCS"
  $CB cp2-fsdp2-w4 4 --cp 2 --cp-comm ring
  $CB tp2-cp2-w4 4 --tp 2 --cp 2 --cp-comm allgather
  $CB cp2-bf16-w2 2 --cp 2 --precision bf16
  $CB pp2-gpipe 2 --pp 2 --pp-schedule gpipe --micro-batch 2
  $CB pp2-1f1b 2 --pp 2 --pp-schedule 1f1b --micro-batch 2
  $CB pp2-interleaved 2 --pp 2 --pp-schedule interleaved --pp-virtual 2 --micro-batch 2
  $CB pp2-zero-bubble 2 --pp 2 --pp-schedule zero-bubble --micro-batch 2
  $CB pp2-1f1b-untied 2 --pp 2 --pp-schedule 1f1b --micro-batch 2 --model "$UNTIED"
  $CB pp2-fsdp2-w4 4 --pp 2 --pp-schedule 1f1b --micro-batch 1
  $CB pp2-fsdp2-permb-w4 4 --pp 2 --pp-schedule 1f1b --micro-batch 1 --pp-reshard per-microbatch
  $CB pp2-zb-bf16 2 --pp 2 --pp-schedule zero-bubble --micro-batch 2 --precision bf16
  $CB pp2-tp2-cp2-w8 8 --pp 2 --tp 2 --cp 2 --pp-schedule interleaved --pp-virtual 2 --micro-batch 1
}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if [ "${1:-}" = --list ]; then
  UNTIED=OUT/demo-untied.json DOCS=OUT/docs.tok
  show() { echo "$*"; }
  CB=show CONFIGS
  exit 0
fi
[ $# -ge 2 ] || { echo "usage: $0 REF_BIN NEW_BIN [OUT]  (or $0 --list)" >&2; exit 2; }
REF=$1 NEW=$2 OUT=${3:-build/bitwise-ab}
DATA=${DATA:-$ROOT/build/data/fortunes.tok}
PY=${PY:-$ROOT/.venv/bin/python}
for f in "$REF" "$NEW"; do [ -x "$f" ] || { echo "error: '$f' is not an executable" >&2; exit 2; }; done
[ -f "$DATA" ] || { echo "error: no token file '$DATA' (make data, or set DATA)" >&2; exit 2; }
[ -x "$PY" ] || { echo "error: no python '$PY' (make venv, or set PY)" >&2; exit 2; }
# The selection: every name of ONLY must be a configuration.
ALL=()
collect() { ALL+=("$1"); }
UNTIED=x DOCS=x CB=collect CONFIGS
for n in ${ONLY:-}; do
  [[ " ${ALL[*]} " == *" $n "* ]] || { echo "error: ONLY names '$n', not a configuration (--list)" >&2; exit 2; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
mkdir -p "$OUT"
# demo's shape (model/config.cpp's preset) with an untied LM head.
UNTIED=$OUT/demo-untied.json
cat >"$UNTIED" <<J
{"architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 128, "intermediate_size": 384,
 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
 "tie_word_embeddings": false, "bos_token_id": 256, "eos_token_id": 257, "rope_theta": 10000.0, "rms_norm_eps": 1e-05}
J
since() { awk -v a="$1" -v b="$EPOCHREALTIME" -v f="$2" 'BEGIN { printf f, b - a }'; }  # T0 FORMAT: seconds since T0
# merge_args ARGS...: MERGED = ARGS with a later option replacing an earlier one of the same name (with
# its values: the words up to the next --option), so that the configurations and NEW_ARGS can
# override the common options (the binary refuses an option given twice).
merge_args() {
  local args=("$@") owner=() i cur=""
  local -A last=()
  for i in "${!args[@]}"; do
    if [[ ${args[i]} == --* ]]; then cur=${args[i]%%=*}:$i; last[${args[i]%%=*}]=$i; fi
    owner[i]=$cur
  done
  MERGED=()
  for i in "${!args[@]}"; do
    local o=${owner[i]}
    if [ -z "$o" ] || [ "${last[${o%:*}]}" = "${o##*:}" ]; then MERGED+=("${args[i]}"); fi
  done
}
# Short documents for the document mask (fortunes.tok is one document: a plain-text file is one):
# tests/e2e/common.sh's short_docs, BOS, 1-38 printable bytes, EOS, random with seed 41; the train
# split 24,000 tokens, the validation split 2,400.
DOCS=$OUT/docs.tok
"$PY" "$ROOT/tests/e2e/short_docs.py" "$DOCS" 24000 2400 || exit 2
train() {  # BIN NP DIR options...: one training into DIR (m.jsonl, ck/, log, cmd); its exit status
  local bin=$1 np=$2 dir=$3; shift 3
  rm -rf "$dir"; mkdir -p "$dir"
  merge_args --model demo --data "$DATA" --seq-len 32 --global-batch 12 --steps 12 --log-every 1 --eval-every 6 \
    --eval-batches 2 --seed 7 --threads 1 --metrics "$dir/m.jsonl" --checkpoint-dir "$dir/ck" --checkpoint-every 6 "$@"
  echo "mpirun --oversubscribe -np $np $bin ${MERGED[*]}" >"$dir/cmd"
  timeout -k 5 600 mpirun --oversubscribe -np "$np" "$bin" "${MERGED[@]}" >"$dir/log" 2>&1
}
selected() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
read -r -a REF_EXTRA <<<"${REF_ARGS:-}"
read -r -a NEW_EXTRA <<<"${NEW_ARGS:-}"
n_run=0 n_equal=0 T0=$EPOCHREALTIME
run() {  # name np options...: both runs, then the comparison's one line
  local name=$1 np=$2; shift 2
  selected "$name" || return 0
  n_run=$((n_run + 1))
  local secs=() failed="" t0 rc
  t0=$EPOCHREALTIME; train "$REF" "$np" "$OUT/$name-ref" "$@" "${REF_EXTRA[@]}"; rc=$?
  secs+=("$(since "$t0" %.1f)"); [ $rc = 0 ] || failed+="ref exit $rc ($OUT/$name-ref/log); "
  t0=$EPOCHREALTIME; train "$NEW" "$np" "$OUT/$name-new" "$@" "${NEW_EXTRA[@]}"; rc=$?
  secs+=("$(since "$t0" %.1f)"); [ $rc = 0 ] || failed+="new exit $rc ($OUT/$name-new/log); "
  if [ -n "$failed" ]; then
    echo "$name: FAILED: $failed"
    for which in ref new; do  # a failed run's error lines (else its last lines)
      [[ $failed == *"$which exit"* ]] || continue
      { grep -m 3 -i 'error' "$OUT/$name-$which/log" || tail -3 "$OUT/$name-$which/log"; } | sed "s/^/    $which| /"
    done
    return
  fi
  "$PY" - "$OUT/$name-ref" "$OUT/$name-new" "$name" "${secs[0]}" "${secs[1]}" <<'PY' && n_equal=$((n_equal + 1))
import json, os, sys
import h5py, numpy as np
a, b, name, ta, tb = sys.argv[1:]
def rows(d):  # the metrics' results, values as repr (shortest round-trip: equal strings = equal doubles)
    out = []
    for r in map(json.loads, open(d + "/m.jsonl")):
        if "loss" in r: out.append(f"step {r.get('step')} loss {r['loss']!r} grad_norm {r.get('grad_norm')!r}")
        if "val_loss" in r: out.append(f"step {r.get('step')} val_loss {r['val_loss']!r}")
    return out
def same(x, y):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != y.dtype or x.shape != y.shape: return False
    return x.tolist() == y.tolist() if x.dtype.kind == "O" else x.tobytes() == y.tobytes()
def where(x, y):  # the first differing element of two same-shaped numeric arrays
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"dtype/shape {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
    if x.dtype.kind == "O" or x.ndim == 0: return f"{x.tolist()!r} vs {y.tolist()!r}"
    fx, fy = x.reshape(-1), y.reshape(-1)
    bx, by = fx.view(np.uint8).reshape(fx.size, -1), fy.view(np.uint8).reshape(fy.size, -1)
    bad = np.flatnonzero((bx != by).any(axis=1))
    i = np.unravel_index(bad[0], x.shape)
    return f"{bad.size} of {fx.size} elements, first at {list(map(int, i))}: {fx[bad[0]]} vs {fy[bad[0]]}"
diffs, n = [], [0]
def walk(g, h, path):
    for k in sorted(set(g) | set(h)):
        if k not in h or k not in g:
            diffs.append(f"{path}{k}: only in {'ref' if k in g else 'new'}"); continue
        if isinstance(g[k], h5py.Dataset) != isinstance(h[k], h5py.Dataset):
            diffs.append(f"{path}{k}: a dataset in one, a group in the other"); continue
        if isinstance(g[k], h5py.Dataset):
            n[0] += 1
            x, y = g[k][()], h[k][()]
            if not same(x, y): diffs.append(f"{path}{k}: {where(x, y)}")
        else: walk(g[k], h[k], path + k + "/")
    for k in sorted(set(g.attrs) | set(h.attrs)):
        if k not in h.attrs or k not in g.attrs: diffs.append(f"{path}@{k}: only in {'ref' if k in g.attrs else 'new'}")
        elif not same(g.attrs[k], h.attrs[k]): diffs.append(f"{path}@{k}: {where(g.attrs[k], h.attrs[k])}")
la, lb = rows(a), rows(b)
mdiff = None
if la != lb:
    bad = [i for i, (x, y) in enumerate(zip(la, lb)) if x != y]
    nbad = len(bad) + abs(len(la) - len(lb))
    first = f"{la[bad[0]]} vs {lb[bad[0]]}" if bad else f"{len(la)} vs {len(lb)} rows"
    mdiff = f"metrics: {first} ({nbad} of {max(len(la), len(lb))} rows differ)"
fa, fb = (sorted(f for f in os.listdir(d + "/ck") if f.endswith(".h5")) for d in (a, b))
if fa != fb: diffs.append(f"checkpoint files {fa} vs {fb}")
for f in sorted(set(fa) & set(fb)):
    with h5py.File(a + "/ck/" + f, "r") as g, h5py.File(b + "/ck/" + f, "r") as h: walk(g, h, f + ":/")
tail = f"ref {ta} s, new {tb} s"
if not la or not fa:
    print(f"{name}: DIFFERS: nothing to compare: {len(la)} metrics rows, {len(fa)} checkpoints; {tail}")
    sys.exit(1)
if mdiff or diffs:
    ck = f"checkpoints: {diffs[0]} ({len(diffs)} entr{'y differs' if len(diffs) == 1 else 'ies differ'})" if diffs \
        else "checkpoints equal"
    print(f"{name}: DIFFERS: " + (f"{mdiff}; {ck}" if mdiff else f"{ck}; metrics equal") + f"; {tail}")
    sys.exit(1)
print(f"{name}: equal ({len(la)} metrics rows, {len(fa)} checkpoints, {n[0]} datasets; {tail})")
PY
}
CB=run CONFIGS
fail=0
# Coverage: the document mask must change the losses (documents inside the training windows): REF
# once more with cp2-doc-ring's options but the causal mask.
if selected cp2-doc-ring && [ -f "$OUT/cp2-doc-ring-ref/m.jsonl" ]; then
  train "$REF" 2 "$OUT/coverage-causal" --cp 2 --cp-comm ring --data "$DOCS" "${REF_EXTRA[@]}" \
    || { echo "coverage: the causal run failed ($OUT/coverage-causal/log)"; fail=1; }
  loss_rows() { grep -o '"loss":[^,}]*' "$1/m.jsonl"; }
  if [ $fail = 0 ] && cmp -s <(loss_rows "$OUT/coverage-causal") <(loss_rows "$OUT/cp2-doc-ring-ref"); then
    echo "coverage: the document mask did not change the losses of $DOCS (no document boundary seen?)"; fail=1
  elif [ $fail = 0 ]; then
    echo "coverage: the document mask changes the losses (cp2-doc-ring against the causal mask, REF)"
  fi
fi
echo "$n_equal of $n_run configurations equal ($(since "$T0" %.0f) s in all)"
[ $fail = 0 ] && [ $n_equal = $n_run ]
