#!/usr/bin/env bash
# Files that change, or are not files, while shardtrain reads them (issue 39, part 1):
#  1. a symbolic link of a Hugging Face directory swapped to a file outside it while --mode import
#     reads it, deterministically: the test hook SHARDTRAIN_TEST_FILE_PAUSE stops the reader after
#     the name was checked and before the open ("open"), or after a safetensors header was read and
#     before its tensors ("read"); the test swaps the link meanwhile. Every "open" swap (config,
#     tokenizer file, index, each shard) is refused naming the outside file; after a "read" swap
#     the checkpoint holds the inside file's bytes (one descriptor from header to last tensor):
#     h5py finds it bitwise equal to an import of the untouched directory;
#  2. a FIFO, a directory, a character device and a socket in each place an input is read from
#     (config.json, each tokenizer file, the index, a shard, model.safetensors, --model, --config,
#     --data, --input, --tokenizer, a checkpoint) is refused at once with "not a regular file"
#     (or "is a directory") on every rank, never waited on;
#  1b. --hf-dir itself a link, pointed at another model between opening the directory and opening
#     each file (the hook, "open"): every file still comes from the directory first opened;
#  2b. a file on /proc or /sys (--model, --config, --data, --input, --tokenizer, --hf-dir, a file of
#     a Hugging Face directory) refused by its file system's type, naming it;
#  3. SIGTERM and SIGINT end each mode that does not train within 2 s (the test hook
#     SHARDTRAIN_TEST_MODE_PAUSE holds the mode after its signal dispositions are set);
#  4. smaller refusals: safetensors shapes [64.9, 64.2], 2^63 and 1e300; rope_parameters named.
source "$(dirname "$0")/common.sh"
DATA=$WORK/c.tok
head -c 40000 /usr/share/games/fortunes/fortunes >"$WORK/small.txt"
"$BIN" --mode prepare --input "$WORK/small.txt" --out "$DATA" >/dev/null
printf '{"vocab_size": 512, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64}\n' >"$WORK/m.json"
"$BIN" --model "$WORK/m.json" --data "$DATA" --seq-len 16 --global-batch 2 --eval-batches 1 --threads 1 --steps 1 \
  --checkpoint-dir "$WORK/ck" >/dev/null
CKPT=$WORK/ck/step_00000001.h5
"$BIN" --mode export "$CKPT" --out "$WORK/hf" --max-shard-size 12KB >/dev/null
printf '{"model_max_length": 64}\n' >"$WORK/hf/tokenizer_config.json"  # a tokenizer file, carried by import
SHARDS=$(cd "$WORK/hf" && ls model-*-of-*.safetensors)
[ "$(echo "$SHARDS" | wc -l)" -ge 3 ] || fail "the export made fewer than 3 shards: $SHARDS"
"$BIN" --mode import --hf-dir "$WORK/hf" --out "$WORK/ref.h5" >/dev/null

# ---- 1. links swapped while import reads ------------------------------------------------------
# An outside copy of every file, with the same names: the shards' headers equal, every value 7.0.
mkdir -p "$WORK/outside"
cp "$WORK/hf"/* "$WORK/outside/"
"$PY" - "$WORK/outside" <<'PY'
import glob, json, struct, sys
for p in glob.glob(sys.argv[1] + "/model-*.safetensors"):
    b = bytearray(open(p, "rb").read())
    n = struct.unpack_from("<Q", b)[0]
    assert all(v["dtype"] == "F32" for k, v in json.loads(b[8:8 + n]).items() if k != "__metadata__")
    b[8 + n:] = struct.pack("<f", 7.0) * ((len(b) - 8 - n) // 4)
    open(p, "wb").write(bytes(b))
PY
printf '{"model_max_length": 64, "outside": true}\n' >"$WORK/outside/tokenizer_config.json"

# swap POINT NAME: a fresh copy of the directory whose NAME is a link to NAME.real beside it; import
# pauses at POINT for NAME, the link is pointed at ../outside/NAME, import goes on. Output: $LOG, $RC.
swap() {
  local point=$1 name=$2 d=$WORK/swap_$1_$2 flag=$WORK/flag_$1_$2
  rm -rf "$d" "$WORK/outside_$1_$2"
  cp -r "$WORK/hf" "$d"
  mv "$d/$name" "$d/$name.real"
  ln -s "$name.real" "$d/$name"
  LOG=$WORK/swap_$1_$2.log
  RC=0
  SHARDTRAIN_TEST_FILE_PAUSE="$point:$name:$flag" timeout -k 5 60 \
    "$BIN" --mode import --hf-dir "$d" --out "$WORK/swap_$1_$2.h5" >"$LOG" 2>&1 &
  local pid=$! i
  for ((i = 0; i < 300; i++)); do [ -e "$flag" ] && break; sleep 0.1; done
  [ -e "$flag" ] || { kill "$pid"; cat "$LOG"; fail "swap $point $name: the reader never reached the pause"; }
  ln -sfn "../outside/$name" "$d/$name"
  rm -f "$flag"
  wait "$pid" || RC=$?
}
for name in config.json tokenizer_config.json model.safetensors.index.json $SHARDS; do
  swap open "$name"
  [ "$RC" -ne 0 ] || { cat "$LOG"; fail "open swap of $name: import succeeded with a link to a file outside"; }
  grep -qF "names '$name', a symbolic link to '$(realpath "$WORK/outside/$name")', outside of directory" "$LOG" \
    || { cat "$LOG"; fail "open swap of $name: not refused as a link outside"; }
  [ ! -e "$WORK/swap_open_$name.h5" ] || fail "open swap of $name: a checkpoint was written"
  echo "ok: $name swapped to a file outside between its check and its open: refused"
done
for name in $SHARDS; do
  swap read "$name"
  [ "$RC" -eq 0 ] || { cat "$LOG"; fail "read swap of $name: import failed"; }
  "$PY" "$ROOT/tests/e2e/h5_equal.py" "$WORK/ref.h5" "$WORK/swap_read_$name.h5" >"$WORK/eq.log" \
    || { cat "$WORK/eq.log"; fail "read swap of $name: the checkpoint differs from the untouched directory's (outside bytes read?)"; }
  echo "ok: $name swapped after its header was read: every tensor came from the file whose header was read (bitwise as the reference)"
done

# ---- 1b. --hf-dir itself a link, pointed at another model while import reads (issue 53) ----------
# $WORK/outside is another model with the same file names (every weight 7.0, another
# tokenizer_config.json): first, imported whole, it differs from the reference (else the test below
# could not fail). --hf-dir is $WORK/cur -> hf; import pauses before it opens NAME, cur is pointed
# at outside, import goes on: the directory was opened once, before, so every file, NAME and those
# after it included, must come from hf: the checkpoint bitwise equal to the reference (h5py).
"$BIN" --mode import --hf-dir "$WORK/outside" --out "$WORK/outside.h5" >/dev/null
names=(config.json tokenizer_config.json model.safetensors.index.json $SHARDS)
for name in "${names[@]}"; do
  ln -sfn hf "$WORK/cur"
  flag=$WORK/flag_dir_$name
  SHARDTRAIN_TEST_FILE_PAUSE="open:$name:$flag" timeout -k 5 60 \
    "$BIN" --mode import --hf-dir "$WORK/cur" --out "$WORK/dir_$name.h5" >"$WORK/dir_$name.log" 2>&1 &
  pid=$!
  for ((i = 0; i < 300; i++)); do [ -e "$flag" ] && break; sleep 0.1; done
  [ -e "$flag" ] || { kill "$pid"; cat "$WORK/dir_$name.log"; fail "--hf-dir swap at $name: the reader never reached the pause"; }
  ln -sfn outside "$WORK/cur"
  rm -f "$flag"
  wait "$pid" || { cat "$WORK/dir_$name.log"; fail "--hf-dir swap at $name: import failed"; }
done
# (One h5py process for the comparisons, tests/e2e/h5_equal.py's.)
"$PY" - "$ROOT/tests/e2e" "$WORK" "${names[@]}" >"$WORK/eq.log" <<'PY' || { cat "$WORK/eq.log"; fail "--hf-dir swap: see above"; }
import sys
sys.path.insert(0, sys.argv[1])
from h5_equal import main as h5_equal
work, bad = sys.argv[2], 0
if h5_equal(work + "/ref.h5", work + "/outside.h5") == 0:
    print("FAIL: the outside model imports as the reference: the test could not fail"); bad = 1
for name in sys.argv[3:]:
    if h5_equal(work + "/ref.h5", f"{work}/dir_{name}.h5") != 0:
        print(f"FAIL: --hf-dir swap at {name}: the checkpoint holds files of the other model"); bad = 1
sys.exit(bad)
PY
echo "ok: --hf-dir (a link) pointed at another model before each of ${names[*]} was opened: every file from the directory first opened (bitwise the reference); the other model alone differs"
rm -f "$WORK/cur"

# ---- 2. not regular files -----------------------------------------------------------------------
# make_special KIND PATH: a FIFO, directory, character device (1,3: /dev/null's) or socket at PATH.
make_special() {
  rm -rf "$2"
  case $1 in
    fifo) mkfifo "$2" ;;
    dir) mkdir "$2" ;;
    device) mknod "$2" c 1 3 ;;
    socket) "$PY" -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$2" ;;
  esac
}
# refused_at_once NAME WANT NP CMD...: expect_fail within 10 s (a FIFO waited on would hang).
refused_at_once() {
  local name=$1 want=$2 np=$3 t0=$SECONDS
  shift 3
  expect_fail "$name" "$want" "$np" "$@"
  [ $((SECONDS - t0)) -le 10 ] || fail "$name: took $((SECONDS - t0)) s"
}
printf 'model = %s\ndata = %s\nseq-len = 16\nglobal-batch = 2\nsteps = 1\n' "$WORK/m.json" "$DATA" >"$WORK/job.ini"
for kind in fifo dir device socket; do
  what="is not a regular file"
  # In the Hugging Face directory: each file import reads.
  for name in config.json tokenizer.json tokenizer_config.json model.safetensors.index.json $(echo "$SHARDS" | head -1); do
    d=$WORK/nr_$kind
    rm -rf "$d" && cp -r "$WORK/hf" "$d"
    make_special "$kind" "$d/$name"
    refused_at_once "nr_${kind}_$name" "'$d/$name' $what" 2 --mode import --hf-dir "$d" --out "$WORK/x.h5"
  done
  d=$WORK/nr1_$kind
  rm -rf "$d" && mkdir -p "$d" && cp "$WORK/hf/config.json" "$d/"
  make_special "$kind" "$d/model.safetensors"
  refused_at_once "nr_${kind}_single" "'$d/model.safetensors' $what" 2 --mode import --hf-dir "$d" --out "$WORK/x.h5"
  # Named by the user.
  make_special "$kind" "$WORK/special.json"
  refused_at_once "nr_${kind}_model" "model config file '$WORK/special.json' $what" 2 --mode plan --model "$WORK/special.json" --world-size 2
  make_special "$kind" "$WORK/special.ini"
  refused_at_once "nr_${kind}_config" "job file '$WORK/special.ini' $what" 2 --config "$WORK/special.ini"
  make_special "$kind" "$WORK/special.tok"
  [ "$kind" = dir ] && want="token file '$WORK/special.tok' is a directory" || want="token file '$WORK/special.tok' $what"
  refused_at_once "nr_${kind}_data" "$want" 2 --model "$WORK/m.json" --data "$WORK/special.tok" --seq-len 16 --global-batch 2
  make_special "$kind" "$WORK/special.txt"
  if [ "$kind" != dir ]; then  # (a directory is a valid --input: its files are read)
    refused_at_once "nr_${kind}_input" "input text '$WORK/special.txt' $what" 1 --mode prepare --input "$WORK/special.txt" --out "$WORK/x.tok"
    make_special "$kind" "$WORK/special.model"
    refused_at_once "nr_${kind}_tokenizer" "tokenizer '$WORK/special.model' $what" 1 --mode prepare --tokenizer "$WORK/special.model" --input "$WORK/small.txt" --out "$WORK/x.tok"
  fi
  make_special "$kind" "$WORK/special.h5"
  [ "$kind" = dir ] && want="is a directory, not a checkpoint file" || want="checkpoint '$WORK/special.h5': is not a regular file"
  refused_at_once "nr_${kind}_checkpoint" "$want" 2 --mode inspect "$WORK/special.h5"
  # Found in an --input directory.
  rm -rf "$WORK/indir" && mkdir -p "$WORK/indir" && cp "$WORK/small.txt" "$WORK/indir/a.txt"
  [ "$kind" = dir ] || { make_special "$kind" "$WORK/indir/b.txt";
    refused_at_once "nr_${kind}_indir" "input text '$WORK/indir/b.txt' $what" 1 --mode prepare --input "$WORK/indir" --out "$WORK/x.tok"; }
done
# The checkpoint directory's `latest` and the --metrics file a resume continues (found by a break
# test: both were opened by name, blocking, and SIGTERM could not end the wait).
cp -r "$WORK/ck" "$WORK/ckf"
rm "$WORK/ckf/latest" && mkfifo "$WORK/ckf/latest"
refused_at_once latest_fifo "'$WORK/ckf/latest' is not a regular file (a FIFO)" 2 \
  --model "$WORK/m.json" --data "$DATA" --seq-len 16 --global-batch 2 --eval-batches 1 --threads 1 --steps 2 \
  --checkpoint-dir "$WORK/ckf" --resume auto
mkfifo "$WORK/metrics.fifo"
refused_at_once metrics_fifo "'$WORK/metrics.fifo' is a FIFO" 2 \
  --model "$WORK/m.json" --data "$DATA" --seq-len 16 --global-batch 2 --eval-batches 1 --threads 1 --steps 2 \
  --checkpoint-dir "$WORK/ck" --resume auto --accept-change steps --metrics "$WORK/metrics.fifo"
echo "ok: FIFO, directory, device and socket refused at once in every place an input is read"

# ---- 2b. files of pseudo file systems (issue 53) ----------------------------------------------------
# /proc and /sys files say size 0 (or 4096) whatever they hold: refused by the file system's type
# (fstatfs on the descriptor), naming the input and the file system, on every rank.
PROCFS="lies on the proc pseudo file system"
ln -sfn /proc/self/status "$WORK/status.json"
expect_fail pseudo_model "model config file '$WORK/status.json' $PROCFS" 2 --mode plan --model "$WORK/status.json" --world-size 2
expect_fail pseudo_config "job file '/proc/self/status' $PROCFS" 2 --config /proc/self/status
expect_fail pseudo_data "token file '/proc/self/environ' $PROCFS" 2 --model "$WORK/m.json" --data /proc/self/environ --seq-len 16 --global-batch 2
expect_fail pseudo_input "input text '/proc/self/status' $PROCFS" 1 --mode prepare --input /proc/self/status --out "$WORK/x.tok"
expect_fail pseudo_tokenizer "tokenizer '/proc/self/cmdline' $PROCFS" 1 --mode prepare --tokenizer /proc/self/cmdline --input "$WORK/small.txt" --out "$WORK/x.tok"
expect_fail pseudo_hfdir "option '--hf-dir' '/proc/self' $PROCFS" 2 --mode import --hf-dir /proc/self --out "$WORK/x.h5"
# In a Hugging Face directory, a link into /proc or /sys: refused by where the file lies.
for name in config.json tokenizer.json; do
  rm -rf "$WORK/pseudo_hf" && cp -r "$WORK/hf" "$WORK/pseudo_hf"
  ln -sfn /proc/self/status "$WORK/pseudo_hf/$name"
  expect_fail "pseudo_hf_$name" "file '$WORK/pseudo_hf/$name' $PROCFS" 2 --mode import --hf-dir "$WORK/pseudo_hf" --out "$WORK/x.h5"
done
if [ "$(stat -f -c %T /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)" = sysfs ]; then
  ln -sfn /sys/kernel/mm/transparent_hugepage/enabled "$WORK/sys.json"
  expect_fail pseudo_sysfs "model config file '$WORK/sys.json' lies on the sysfs pseudo file system" 2 --mode plan \
    --model "$WORK/sys.json" --world-size 2
fi
echo "ok: files of /proc and /sys refused by their file system's type"

# ---- 3. SIGTERM / SIGINT in the modes that do not train -------------------------------------------
"$BIN" --mode tokenizer --input "$WORK/small.txt" --vocab-size 400 --out "$WORK/sp.model" >/dev/null
# stops MODE SIGNAL CMD...: the mode, paused by the hook, ends within 2 s of SIGNAL, killed by it.
stops() {
  local mode=$1 sig=$2 flag=$WORK/pause_$1_$2
  shift 2
  SHARDTRAIN_TEST_MODE_PAUSE=$flag "$BIN" "$@" >"$WORK/sig.log" 2>&1 &
  local pid=$! i rc=0
  for ((i = 0; i < 300; i++)); do [ -e "$flag.0" ] && break; sleep 0.1; done
  [ -e "$flag.0" ] || { kill -9 "$pid"; cat "$WORK/sig.log"; fail "$mode: never reached the pause"; }
  local t0 t1
  t0=$(date +%s%N)
  kill -"$sig" "$pid"
  for ((i = 0; i < 40; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  t1=$(date +%s%N)
  if kill -0 "$pid" 2>/dev/null; then
    rm -f "$flag.0"
    wait "$pid" || true
    fail "$mode: still running 2 s after SIG$sig"
  fi
  wait "$pid" || rc=$?
  local want=$((128 + $(kill -l "$sig")))
  [ "$rc" -eq "$want" ] || { cat "$WORK/sig.log"; fail "$mode: exit status $rc after SIG$sig, expected $want"; }
  echo "ok: --mode $mode ended $(( (t1 - t0) / 1000000 )) ms after SIG$sig (exit status $rc)"
}
for sig in TERM INT; do
  stops import $sig --mode import --hf-dir "$WORK/hf" --out "$WORK/sig_$sig.h5"
  stops export $sig --mode export "$CKPT" --out "$WORK/sig_$sig"
  stops inspect $sig --mode inspect "$CKPT"
  stops plan $sig --mode plan --model "$WORK/m.json" --world-size 2
  stops prepare $sig --mode prepare --input "$WORK/small.txt" --out "$WORK/sig_$sig.tok"
  stops tokenizer $sig --mode tokenizer --input "$WORK/small.txt" --vocab-size 400 --out "$WORK/sig_$sig.model"
  stops generate $sig --mode generate "$CKPT" --prompt "a" --max-new-tokens 2
done
# Training keeps SIGTERM's meaning (a checkpoint, exit 75: tests/e2e/test_preemption.sh).

# ---- 4. smaller refusals ------------------------------------------------------------------------
# shape DIMS WANT: model.safetensors whose first tensor's shape is replaced by DIMS (raw JSON).
"$BIN" --mode export "$CKPT" --out "$WORK/hf1" >/dev/null
shape() {
  local tag=$1 dims=$2 want=$3 d=$WORK/shape_$1
  rm -rf "$d" && cp -r "$WORK/hf1" "$d"
  "$PY" - "$d/model.safetensors" "$dims" <<'PY'
import json, struct, sys
p, dims = sys.argv[1], sys.argv[2]
b = open(p, "rb").read()
n = struct.unpack_from("<Q", b)[0]
h = json.loads(b[8:8 + n])
name = next(k for k in h if k != "__metadata__")
text = json.dumps(h).replace(json.dumps(h[name]["shape"]), "@@", 1)
text = text.replace("@@", dims)
while len(text) % 8: text += " "
open(p, "wb").write(struct.pack("<Q", len(text)) + text.encode() + b[8 + n:])
PY
  expect_fail "shape_$tag" "$want" 2 --mode import --hf-dir "$d" --out "$WORK/x.h5"
}
shape fraction "[64.9, 64.2]" "dimension 0 of its shape (64.9) is not an integer"
shape big "[9223372036854775808, 1]" "dimension 0 of its shape (9223372036854775808) is out of range (2^63 or more)"
shape e300 "[1e300, 1]" "dimension 0 of its shape (1e+300) is out of range (2^63 or more)"
shape negative "[-3, 16]" "dimension 0 of its shape (-3) is negative"
# A NUL byte ends nlohmann::json's input: what follows it must not be ignored (Python's json and
# the safetensors library refuse such files).
rm -rf "$WORK/nul" && cp -r "$WORK/hf" "$WORK/nul"
printf '\0garbage {{{' >>"$WORK/nul/config.json"
expect_fail nul_config "not valid JSON: a NUL byte at byte offset" 2 --mode import --hf-dir "$WORK/nul" --out "$WORK/x.h5"
rm -rf "$WORK/nul" && cp -r "$WORK/hf" "$WORK/nul"
printf '\0{{{' >>"$WORK/nul/model.safetensors.index.json"
expect_fail nul_index "model.safetensors.index.json': not valid JSON: a NUL byte at byte offset" 2 --mode import --hf-dir "$WORK/nul" --out "$WORK/x.h5"
rm -rf "$WORK/nul" && cp -r "$WORK/hf1" "$WORK/nul"
"$PY" - "$WORK/nul/model.safetensors" <<'PY'
import struct, sys
p = sys.argv[1]
b = open(p, "rb").read()
n = struct.unpack_from("<Q", b)[0]
h = b[8:8 + n].rstrip(b" ") + b"\0"
h += b" " * (-len(h) % 8)
open(p, "wb").write(struct.pack("<Q", len(h)) + h + b[8 + n:])
PY
expect_fail nul_header "header: not valid JSON: a NUL byte at byte offset" 2 --mode import --hf-dir "$WORK/nul" --out "$WORK/x.h5"
rm -rf "$WORK/rp" && cp -r "$WORK/hf1" "$WORK/rp"
"$PY" - "$WORK/rp/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.pop("rope_scaling", None)
c["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 0.5, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
json.dump(c, open(sys.argv[1], "w"))
PY
expect_fail rope_parameters "key 'rope_parameters.factor' must be >= 1, got 0.5" 2 --mode import --hf-dir "$WORK/rp" --out "$WORK/x.h5"
echo "ok: input files"
