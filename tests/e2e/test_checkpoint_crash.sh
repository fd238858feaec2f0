#!/usr/bin/env bash
# A job killed in the middle of a save (after the data is written, before it is published) leaves
# `latest` on the previous checkpoint, which loads; --keep-last prunes only after a publish.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
ARGS=(--model tiny --data "$DATA" --seq-len 16 --global-batch 6 --steps 12 --log-every 1 --eval-every 0
  --eval-batches 1 --threads 1 --checkpoint-dir "$WORK/ck" --checkpoint-every 5)
rc=0
timeout -k 5 120 $MPIRUN -np 3 "$BIN" "${ARGS[@]}" --debug-crash-before-publish 10 >"$WORK/crash.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || { cat "$WORK/crash.log"; fail "crash run: exit status $rc"; }
grep -q "crashing after writing step 10 before publishing" "$WORK/crash.log" || fail "crash hook did not fire"
[ "$(cat "$WORK/ck/latest")" = "step_00000005.h5" ] || fail "latest moved to '$(cat "$WORK/ck/latest")'"
# The unpublished data stays under its temporary name, tagged with rank 0's host and process id,
# and so does `latest`'s staged new contents.
host=$(hostname | tr -c 'A-Za-z0-9.\n-' '-')
TMP=$(cd "$WORK/ck" && compgen -G ".step_00000010.h5.*.tmp") || { ls -la "$WORK/ck"; fail "the unpublished data should be left under its temporary name"; }
[[ $TMP =~ ^\.step_00000010\.h5\.($host(_pidns[0-9]+)?)\.([1-9][0-9]*)\.tmp$ ]] || fail "temporary name '$TMP' is not '.step_00000010.h5.$host.<pid>.tmp'"
TAG=${BASH_REMATCH[1]}.${BASH_REMATCH[3]}
[ "$(cat "$WORK/ck/latest.$TAG.tmp")" = "step_00000010.h5" ] || { ls -la "$WORK/ck"; fail "latest.$TAG.tmp should hold step 10's name"; }
[ ! -e "$WORK/ck/step_00000010.h5" ] || fail "step 10 was published"
echo "ok: crash while saving step 10 left latest -> step_00000005.h5, and '$TMP', 'latest.$TAG.tmp'"

timeout -k 5 120 $MPIRUN -np 2 "$BIN" "${ARGS[@]}" --resume auto --keep-last 2 >"$WORK/resume.log" 2>&1 \
  || { cat "$WORK/resume.log"; fail "resume after crash"; }
grep -q "resumed from '$WORK/ck/step_00000005.h5' at step 5 (saved at world size 3)" "$WORK/resume.log" || { cat "$WORK/resume.log"; fail "did not resume from step 5"; }
[ "$(cat "$WORK/ck/latest")" = "step_00000012.h5" ] || fail "latest is not step 12 after the resumed run"
ls "$WORK/ck" | grep -q '^step_00000005.h5$' && fail "keep-last 2 did not prune step 5"
[ "$(ls "$WORK/ck" | grep -c '^step_.*\.h5$')" -eq 2 ] || { ls -la "$WORK/ck"; fail "keep-last 2 left $(ls "$WORK/ck" | grep -c '^step_') checkpoints"; }
# The crashed run's process is gone: its files were removed at the start, each with a note.
for f in "$TMP" "latest.$TAG.tmp"; do
  grep -qF "note: removed '$f' in '$WORK/ck': a temporary file of an interrupted save; process ${TAG##*.} on ${TAG%.*} is gone" \
    "$WORK/resume.log" || { cat "$WORK/resume.log"; fail "no note of the removal of '$f'"; }
done
[ -z "$(ls -A "$WORK/ck" | grep -v '^step_0000001[02]\.h5$\|^latest$\|^\.shardtrain\.lock$')" ] || { ls -la "$WORK/ck"; fail "temporary files left: $(ls -A "$WORK/ck")"; }
echo "ok: resumed from step 5 at 2 ranks (removing '$TMP' and 'latest.$TAG.tmp'), published steps 10 and 12, pruned to the last 2"
