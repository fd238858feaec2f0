#!/usr/bin/env bash
# Stragglers (issue 30 item 3): each log interval every rank's compute and wait time are gathered;
# the step line names the slowest rank and its node when its compute time is more than 1.2x the
# median, and the metrics record min / median / max. The test hook SHARDTRAIN_TEST_SLOW_RANK=R:MS
# (docs/errors.md) makes rank R sleep MS ms at the start of every step: at 3 ranks, rank 1 slowed
# by 400 ms per step on a model whose step takes a few ms must be the one named, on every step
# line, with its host; the other ranks' wait time grows by about what rank 1 sleeps.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
HOST=$(hostname)
run() {  # NAME NP [ENV...]
  local name=$1 np=$2
  shift 2
  env "$@" timeout -k 5 120 $MPIRUN -np "$np" "$BIN" --model tiny --data "$DATA" --seq-len 16 --global-batch 6 \
    --steps 6 --log-every 2 --eval-every 0 --eval-batches 1 --metrics "$WORK/$name.jsonl" >"$WORK/$name.log" 2>&1 ||
    { cat "$WORK/$name.log"; fail "$name: training failed"; }
}
run slow 3 SHARDTRAIN_TEST_SLOW_RANK=1:400
n=$(grep -c "^step .*| straggler: rank 1 on [^,]*, compute [0-9]* ms/step vs median [0-9]*" "$WORK/slow.log" || true)
lines=$(grep -c "^step " "$WORK/slow.log")
[ "$n" -eq "$lines" ] && [ "$lines" -ge 3 ] || { grep "^step" "$WORK/slow.log"; fail "slow: rank 1 named on $n of $lines step lines"; }
grep -q "straggler: rank 1 on $HOST," "$WORK/slow.log" || fail "slow: the straggler's host ($HOST) is not named"
python3 - "$WORK/slow.jsonl" <<'PY' || fail "slow: metrics"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
assert len(rows) >= 3, rows
for r in rows:
    for k in ("compute", "wait"):
        lo, med, hi = r[k + "_ms_min"], r[k + "_ms_median"], r[k + "_ms_max"]
        assert 0 <= lo <= med <= hi, (k, r)
    assert r["straggler_rank"] == 1 and r["slowest_rank"] == 1, r
    assert r["compute_ms_max"] >= 400 > 1.2 * r["compute_ms_median"], r   # rank 1 sleeps 400 ms a step
    assert r["wait_ms_median"] >= 300, r   # the two others wait for it
print(f"ok: slowed rank 1 named on every logged step; compute ms min/median/max of step {rows[-1]['step']}: "
      f"{rows[-1]['compute_ms_min']:.0f}/{rows[-1]['compute_ms_median']:.0f}/{rows[-1]['compute_ms_max']:.0f}, "
      f"wait median {rows[-1]['wait_ms_median']:.0f}")
PY
# Without the hook at one rank: nobody to compare with, nobody named; the fields are still there.
run single 1
! grep -q "straggler" "$WORK/single.log" || fail "single: a straggler named at world size 1"
python3 -c "
import json, sys
r = [json.loads(l) for l in open('$WORK/single.jsonl') if '\"loss\"' in l][-1]
assert r['compute_ms_min'] == r['compute_ms_median'] == r['compute_ms_max'] and r['slowest_rank'] == 0 and 'straggler_rank' not in r, r
" || fail "single: metrics"
echo "ok: world size 1: no straggler, min = median = max"
