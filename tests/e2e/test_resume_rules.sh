#!/usr/bin/env bash
# Resume refuses silent changes (issue 11, items 3, 4, 8 and 9).
#  * A `latest` naming a checkpoint that is gone is refused (naming it; the metrics file and `latest`
#    untouched) unless --start-over, and a fresh run into such a directory too; with an older
#    checkpoint still present, the message names it.
#  * Resuming with another --seq-len, --global-batch, --lr, --warmup or --min-lr (or --steps) is
#    refused naming each changed setting with both values; --accept-change continues with the new
#    values: tokens_seen is cumulative (h5py's view), a lengthened --steps recomputes the schedule
#    (the logged lr equals nanoGPT's formula with the new steps).
#  * Crash before publishing step 6 (checkpoints every 3): the resumed run's metrics file holds every
#    train and val step exactly once, the rows of steps 4-6 moved to .discarded, at 2 and at 3 ranks
#    (at 2 through a symbolic link, which stays one).
#  * A rollback (resume from an older checkpoint) moves the later checkpoints to abandoned/; a CRLF
#    `latest` is read, a damaged one named; --stop-at-step at or before the checkpoint is refused.
#  * A config.json that equals the checkpoint's architecture but not its name (or its
#    initializer_range) resumes and initializes from it; an architecture difference is still refused.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
BASE=(--model tiny --data "$DATA" --log-every 1 --eval-every 0 --eval-batches 1 --threads 1)
ARGS=("${BASE[@]}" --seq-len 16 --global-batch 6 --steps 8)
# geom SEQ BATCH STEPS: the run geometry (an option may be given only once on the command line)
geom() { G=("${BASE[@]}" --seq-len "$1" --global-batch "$2" --steps "$3"); }
run() {  # log np args...
  local log=$1 np=$2
  shift 2
  timeout -k 5 120 $MPIRUN -np "$np" "$BIN" "$@" >"$WORK/$log" 2>&1 || { cat "$WORK/$log"; fail "run $log"; }
}

# --- 3. a dangling `latest` ----------------------------------------------------------------------
run d1.log 2 "${ARGS[@]}" --checkpoint-dir "$WORK/d" --stop-at-step 2 --metrics "$WORK/d.jsonl"
rm "$WORK"/d/step_*.h5
before=$(sha256sum "$WORK/d.jsonl" "$WORK/d/latest")
expect_fail dangling_latest "'$WORK/d/latest' names 'step_00000002.h5', which does not exist" 2 \
  "${ARGS[@]}" --checkpoint-dir "$WORK/d" --resume auto --metrics "$WORK/d.jsonl"
grep -q "No checkpoint is left: to start again from step 0 in this directory, pass '--start-over'" "$WORK/dangling_latest.log" \
  || fail "dangling latest: no way out named"
expect_fail dangling_fresh "holds the 'latest' pointer of an earlier run but none of its checkpoints: pass '--start-over'" 2 \
  "${ARGS[@]}" --checkpoint-dir "$WORK/d" --metrics "$WORK/d.jsonl"
[ "$(sha256sum "$WORK/d.jsonl" "$WORK/d/latest")" = "$before" ] || fail "a refused start changed the metrics file or latest"
run d2.log 2 "${ARGS[@]}" --checkpoint-dir "$WORK/d" --resume auto --start-over --stop-at-step 1 --metrics "$WORK/d.jsonl"
grep -q "starting over from step 0 in '$WORK/d' (--start-over)" "$WORK/d2.log" || fail "no start-over note"
[ "$(grep -c '"loss"' "$WORK/d.jsonl.discarded")" = 2 ] || fail "start-over: the old run's 2 rows were not moved aside"
[ "$(grep -c '"loss"' "$WORK/d.jsonl")" = 1 ] && [ "$(cat "$WORK/d/latest")" = step_00000001.h5 ] || fail "start-over run"
echo "ok: dangling latest refused (resume and fresh run), files untouched; --start-over starts at 0, old rows in .discarded"
run e1.log 2 "${ARGS[@]}" --checkpoint-dir "$WORK/e" --checkpoint-every 2 --stop-at-step 4
printf 'step_00000004.h5\r\n' >"$WORK/e/latest"  # written on Windows: still names step 4
run e2.log 2 "${ARGS[@]}" --checkpoint-dir "$WORK/e" --resume auto --stop-at-step 5 --checkpoint-every 100
grep -q "resumed from '$WORK/e/step_00000004.h5' at step 4" "$WORK/e2.log" || fail "a CRLF latest was not read"
printf 'garbage\n' >"$WORK/e/latest"
expect_fail damaged_latest "'$WORK/e/latest' is damaged: it should hold one checkpoint name like 'step_00000000.h5', not 'garbage'" \
  2 "${ARGS[@]}" --checkpoint-dir "$WORK/e" --resume auto
echo step_00000004.h5 >"$WORK/e/latest"
rm "$WORK/e/step_00000004.h5" "$WORK/e/step_00000005.h5"
expect_fail dangling_with_older "The newest checkpoint still present is 'step_00000002.h5': to continue from it, pass '--resume $WORK/e/step_00000002.h5'" \
  2 "${ARGS[@]}" --checkpoint-dir "$WORK/e" --resume auto

# --- 4. changed settings --------------------------------------------------------------------------
run s1.log 2 "${ARGS[@]}" --checkpoint-dir "$WORK/s" --stop-at-step 3 --metrics "$WORK/s.jsonl"
R=(--checkpoint-dir "$WORK/s" --resume auto)
geom 32 6 8
expect_fail changed_seq_len "--seq-len 16 -> 32. Resuming with them would change the run mid-way" 2 "${G[@]}" "${R[@]}"
geom 16 12 8
expect_fail changed_batch "--global-batch 6 -> 12" 2 "${G[@]}" "${R[@]}"
expect_fail changed_min_lr "--min-lr 0.0001 -> 0.0002" 2 "${ARGS[@]}" "${R[@]}" --min-lr 2e-4
geom 16 6 9
expect_fail changed_steps "--steps 8 -> 9" 2 "${G[@]}" "${R[@]}"
expect_fail changed_two "these settings differ from the checkpoint's: --lr 0.001 -> 0.002, --warmup 10 -> 5" 2 "${ARGS[@]}" "${R[@]}" \
  --lr 2e-3 --warmup 5
grep -q "Pass '--accept-change lr,warmup' to continue with the new values" "$WORK/changed_two.log" || fail "no --accept-change hint"
expect_fail accept_one_of_two "--warmup 10 -> 5" 2 "${ARGS[@]}" "${R[@]}" --lr 2e-3 --warmup 5 --accept-change lr
expect_fail accept_unknown "option '--accept-change' names 'learning-rate', which is not a setting a resume checks" 2 \
  "${ARGS[@]}" "${R[@]}" --accept-change learning-rate
geom 32 6 8
run s2.log 2 "${G[@]}" "${R[@]}" --accept-change "lr, seq-len" --stop-at-step 6 --metrics "$WORK/s.jsonl"
grep -q "note: resume at step 3: accepted change --seq-len 16 -> 32 (--accept-change)" "$WORK/s2.log" || fail "no accepted-change note"
grep -q "note: '--accept-change lr': --lr is unchanged (0.001)" "$WORK/s2.log" || fail "no note for an unchanged accepted setting"
"$PY" - "$WORK/s/step_00000006.h5" <<'PY'
import json, sys, h5py
f = h5py.File(sys.argv[1], "r")
want = 3 * 6 * 16 + 3 * 6 * 32  # steps 1-3 at seq-len 16, steps 4-6 at 32
assert int(f.attrs["tokens_seen"]) == want, (int(f.attrs["tokens_seen"]), want)
seg = json.loads(f.attrs["data_position"])["segments"]
assert [(s["from_step"], s["seq_len"]) for s in seg] == [(0, 16), (3, 32)], seg
print(f"ok: --accept-change seq-len: tokens_seen at step 6 is {want} (3 x 6 x 16 + 3 x 6 x 32), batch history {seg}")
PY
expect_fail stop_before "option '--stop-at-step' (5) is not after the checkpoint's step (6): nothing to train" 2 \
  "${G[@]}" "${R[@]}" --stop-at-step 5
# Rolling back: resuming from step 3 while steps 6 (and 3) exist. The later checkpoint belongs to
# the abandoned continuation: it moves to abandoned/, so --keep-last prunes this run's files last.
cp -r "$WORK/s" "$WORK/rb"
geom 16 6 8
run rb.log 2 "${G[@]}" --checkpoint-dir "$WORK/rb" --resume "$WORK/rb/step_00000003.h5" --stop-at-step 5 --checkpoint-every 1 \
  --keep-last 1
grep -q "moved to '$WORK/rb/abandoned/'" "$WORK/rb.log" || { cat "$WORK/rb.log"; fail "rollback: no note"; }
[ "$(cd "$WORK/rb" && ls step_*.h5)" = step_00000005.h5 ] && [ -f "$WORK/rb/abandoned/step_00000006.h5" ] &&
  [ "$(cat "$WORK/rb/latest")" = step_00000005.h5 ] || { ls -R "$WORK/rb"; fail "rollback: wrong files kept"; }
echo "ok: resuming from step 3 with step 6 present moved step 6 to abandoned/; --keep-last 1 kept this run's step 5"
# Lengthening a finished run: --steps 4 -> 8.
geom 16 6 4
run x1.log 2 "${G[@]}" --warmup 2 --checkpoint-dir "$WORK/x" --metrics "$WORK/x.jsonl"
expect_fail extend_refused "--steps 4 -> 8" 2 "${ARGS[@]}" --warmup 2 --checkpoint-dir "$WORK/x" --resume auto
run x2.log 2 "${ARGS[@]}" --warmup 2 --checkpoint-dir "$WORK/x" --resume auto --accept-change steps --metrics "$WORK/x.jsonl"
grep -q "note: the learning-rate schedule is recomputed from the new settings: step 5 runs at lr" "$WORK/x2.log" || fail "no schedule note"
"$PY" - "$WORK/x.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
assert [r["step"] for r in rows] == list(range(1, 9)), [r["step"] for r in rows]
def lr(s, steps, lr=1e-3, min_lr=1e-4, warmup=2):  # nanoGPT's get_lr at 0-based step s
    if s < warmup:
        return lr * (s + 1) / warmup
    p = min(1.0, (s - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * p)) * (lr - min_lr)
for r in rows:
    want = lr(r["step"] - 1, 4 if r["step"] <= 4 else 8)
    assert abs(r["lr"] - want) <= 1e-12 * want, (r, want)
assert rows[4]["lr"] > rows[3]["lr"], "the recomputed schedule rises at the extension (the old one would fall to min_lr)"
print("ok: --steps 4 -> 8 with --accept-change steps: lr of steps 1-4 follows steps=4, steps 5-8 steps=8 (nanoGPT's formula)")
PY

# --- 8. metrics after a crash ----------------------------------------------------------------------
M=(--model tiny --data "$DATA" --seq-len 16 --global-batch 6 --steps 8 --log-every 1 --eval-every 2 --eval-batches 1 --threads 1)
run ref.log 2 "${M[@]}" --metrics "$WORK/ref.jsonl"
mkdir -p "$WORK/shared"
ln -s "$WORK/shared/real.jsonl" "$WORK/m2.jsonl"  # the metrics path of np 2 is a symbolic link
for np in 2 3; do
  rc=0
  # Synchronous saves: the crash then comes right after step 6, so exactly steps 4-6 and the
  # evaluations at 4 and 6 (5 rows) are written after the last published checkpoint (3). With a
  # background write, how many more steps run before its crash depends on the machine (the writer
  # runs at nice 19); test_checkpoint_async.sh covers a crash during a background write.
  timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${M[@]}" --checkpoint-dir "$WORK/m$np" --checkpoint-every 3 --debug-crash-before-publish 6 \
    --checkpoint-async off --metrics "$WORK/m$np.jsonl" >"$WORK/crash$np.log" 2>&1 || rc=$?
  [ "$rc" = 86 ] || { cat "$WORK/crash$np.log"; fail "crash run: exit status $rc"; }
  run "resume$np.log" "$np" "${M[@]}" --checkpoint-dir "$WORK/m$np" --resume auto --metrics "$WORK/m$np.jsonl"
  real=$WORK/m$np.jsonl
  [ "$np" = 2 ] && { [ -L "$WORK/m2.jsonl" ] || fail "the metrics link was replaced by a file"; real=$WORK/shared/real.jsonl; }
  grep -q "metrics: moved 5 line(s) of steps after 3 (or unreadable) from '$real' to '$real.discarded'" "$WORK/resume$np.log" \
    || { cat "$WORK/resume$np.log"; fail "no metrics note"; }
  "$PY" - "$WORK/ref.jsonl" "$real" "$real.discarded" "$np" <<'PY'
import json, sys
ref, got, aside = ([json.loads(l) for l in open(p)] for p in sys.argv[1:4])
np_ = sys.argv[4]
key = lambda r: ("val" if "val_loss" in r else "train", r["step"])
assert sorted(map(key, got)) == sorted(map(key, ref)), f"rows differ: {sorted(map(key, got))}"
assert len(set(map(key, got))) == len(got), "a row appears twice"
assert sorted(map(key, aside)) == [("train", 4), ("train", 5), ("train", 6), ("val", 4), ("val", 6)], sorted(map(key, aside))
r, g = {key(x): x.get("loss", x.get("val_loss")) for x in ref}, {key(x): x.get("loss", x.get("val_loss")) for x in got}
worst = max(abs(r[k] - g[k]) / abs(r[k]) for k in r)
assert worst <= (0 if np_ == "2" else 1e-5), worst
print(f"ok: crash before publishing step 6, resumed at {np_} ranks: {len(got)} metrics rows, each step once "
      f"(train 1-8, val 2-8), steps 4-6 moved aside; losses within {worst:.1e} of the uninterrupted run")
PY
done

# --- 9. labels are not architecture ----------------------------------------------------------------
cat >"$WORK/tiny.json" <<'J'
{"architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 32, "intermediate_size": 64,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "initializer_range": 0.05, "tie_word_embeddings": true,
 "bos_token_id": 256, "eos_token_id": 257}
J
sed 's/"rope_theta": 10000.0/"rope_theta": 20000.0/' "$WORK/tiny.json" >"$WORK/theta.json"
N=(--data "$DATA" --log-every 1 --eval-every 0 --eval-batches 1 --threads 1 --seq-len 32 --global-batch 6 --steps 8)
run n1.log 2 --model "$WORK/tiny.json" "${N[@]}" --checkpoint-dir "$WORK/s" --resume auto --stop-at-step 7
grep -q "resumed from '$WORK/s/step_00000006.h5' at step 6" "$WORK/n1.log" || fail "name: did not resume"
run n2.log 2 --model "$WORK/tiny.json" "${N[@]}" --init-from "$WORK/s/step_00000003.h5" --stop-at-step 1
grep -q "initialized weights from" "$WORK/n2.log" || fail "name: --init-from"
expect_fail name_theta "model config does not match the requested one (rope_theta: checkpoint has 10000.0, requested 20000.0)" 2 \
  --model "$WORK/theta.json" "${N[@]}" --init-from "$WORK/s/step_00000003.h5"
echo "ok: a config.json named 'custom' (initializer_range 0.05) resumes and --init-from's the preset 'tiny' checkpoint; rope_theta still refused"
