#!/usr/bin/env bash
# Issue 53: JSON from strangers is read within limits (include/shardtrain/runtime/json_input.h). Safetensors
# files whose headers are ~90 MB (under the format's 100 MB limit), imported at 2 ranks, each
# accepted or refused within 30 s with a peak RSS (VmHWM, getrusage's ru_maxrss) under 400 MB per
# rank, where nlohmann::json's whole-DOM parse took ~3.4 GB per rank (deep nesting) and hours of
# quadratic checks (1.4 million entries):
#   deep:     a valid model whose first entry has an extra key holding ~45 million nested arrays:
#             refused at level 17 ("JSON nested deeper than 16 levels");
#   string:   a valid model whose __metadata__ holds one 90 MB string: imported, and the checkpoint's
#             weights equal the plain import's (h5py);
#   entries:  the model's tensors plus 1.4 million empty ones: refused at the first tensor past what
#             the config's model can hold;
# and a config.json nested 10^5 deep: refused naming the limit (64 levels of a config.json).
source "$(dirname "$0")/common.sh"
# One reader: no JSON text is parsed in src/ but through json_input.h (read_json / scan_json).
others=$(grep -rnE "json::parse\(|sax_parse\(|json::accept\(" "$ROOT/src" | grep -v "^$ROOT/src/runtime/json_input.cpp:" || true)
[ -z "$others" ] || fail "JSON parsed outside json_input.h: $others"
DATA=$WORK/c.tok
head -c 20000 /usr/share/games/fortunes/fortunes >"$WORK/small.txt"
"$BIN" --mode prepare --input "$WORK/small.txt" --out "$DATA" >/dev/null
printf '{"vocab_size": 512, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64}\n' >"$WORK/m.json"
"$BIN" --model "$WORK/m.json" --data "$DATA" --seq-len 16 --global-batch 2 --eval-batches 1 --threads 1 --steps 1 \
  --checkpoint-dir "$WORK/ck" >/dev/null
"$BIN" --mode export "$WORK/ck/step_00000001.h5" --out "$WORK/hf" >/dev/null
timeout -k 5 60 $MPIRUN -np 2 "$BIN" --mode import --hf-dir "$WORK/hf" --out "$WORK/plain.h5" >/dev/null 2>&1 \
  || fail "the plain model does not import"

# big KIND DIR: a copy of the model whose model.safetensors header is rewritten for KIND.
big() {
  rm -rf "$2" && cp -r "$WORK/hf" "$2"
  "$PY" - "$1" "$2/model.safetensors" <<'PY'
import json, struct, sys
kind, p = sys.argv[1], sys.argv[2]
b = open(p, "rb").read()
n = struct.unpack_from("<Q", b)[0]
h, data = json.loads(b[8:8 + n]), b[8 + n:]
names = [k for k in h if k != "__metadata__"]
if kind == "deep":
    depth = 45_000_000
    text = json.dumps(h)
    first = json.dumps(names[0]) + ": {"
    i = text.index(first) + len(first)
    text = text[:i] + '"x": ' + "[" * depth + "]" * depth + ", " + text[i:]
elif kind == "string":
    h["__metadata__"]["blob"] = "x" * 90_000_000
    text = json.dumps(h)
else:  # entries: 1.4 million empty tensors at the end of the buffer, beside the model's own
    end = len(data)
    text = json.dumps(h)[:-1] + "".join(
        f',"e{i}":{{"dtype":"F32","shape":[0],"data_offsets":[{end},{end}]}}' for i in range(1_400_000)) + "}"
text = text.encode()
text += b" " * (-len(text) % 8)
assert 80_000_000 < len(text) < 100_000_000, len(text)
open(p, "wb").write(struct.pack("<Q", len(text)) + text + data)
PY
}

# imp NAME WANT_RC WANT: import at 2 ranks, each rank's exit status and peak RSS measured
# (peak_rss.py); within 30 s, every rank exits WANT_RC under 400 MB and, for a refusal, reports WANT.
imp() {
  local name=$1 want_rc=$2 want=$3 t0=$SECONDS
  rm -f "$WORK/$name".rss.* "$WORK/$name.h5"
  timeout -k 5 60 $MPIRUN -np 2 "$PY" "$ROOT/tests/e2e/peak_rss.py" "$WORK/$name.rss" "$BIN" --mode import \
    --hf-dir "$WORK/$name" --out "$WORK/$name.h5" >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name: mpirun failed"; }
  local dt=$((SECONDS - t0)) rc kb mb=""
  [ "$dt" -le 30 ] || fail "$name: took $dt s, more than 30"
  for r in 0 1; do
    read -r rc kb <"$WORK/$name.rss.$r" || fail "$name: rank $r wrote no status"
    [ "$rc" -eq "$want_rc" ] || { cat "$WORK/$name.log"; fail "$name: rank $r exit status $rc, expected $want_rc"; }
    [ "$kb" -lt 409600 ] || fail "$name: rank $r peaked at $((kb / 1024)) MB, more than 400 MB"
    [ -z "$want" ] || grep -q "error \[rank $r/2\].*$want" "$WORK/$name.log" \
      || { cat "$WORK/$name.log"; fail "$name: rank $r did not report '$want'"; }
    mb="$mb $((kb / 1024))"
  done
  echo "ok: $name: exit $want_rc in $dt s, peak RSS (MB, ranks 0 1):$mb${want:+; $(grep -m1 -o "$want" "$WORK/$name.log")}"
}

big deep "$WORK/deep"
imp deep 1 "header: JSON nested deeper than 16 levels (the limit for a safetensors header)"
big string "$WORK/string"
imp string 0 ""
"$PY" - "$WORK/plain.h5" "$WORK/string.h5" <<'PY' || fail "string: the imported checkpoint's datasets differ from the plain import's"
import sys, h5py, numpy as np
def datasets(p):
    out = {}
    with h5py.File(p, "r") as f:
        f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
    return out
a, b = datasets(sys.argv[1]), datasets(sys.argv[2])
assert a.keys() == b.keys() and len(a) > 0, (a.keys() ^ b.keys())
for k in a:
    assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
PY
big entries "$WORK/entries"
imp entries 1 "tensors, the most expected here"
grep -m1 -o "holds more than.*" "$WORK/entries.log" | head -1
rm -rf "$WORK/deep" "$WORK/string" "$WORK/entries"

# A config.json nested 10^5 deep (the model's own, with one more key).
rm -rf "$WORK/cfg" && cp -r "$WORK/hf" "$WORK/cfg"
"$PY" - "$WORK/cfg/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
text = json.dumps(c)[:-1] + ', "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
open(sys.argv[1], "w").write(text)
PY
imp cfg 1 "JSON nested deeper than 64 levels (the limit for a config.json)"
expect_fail cfg_model "JSON nested deeper than 64 levels (the limit for a config.json)" 2 --model "$WORK/cfg/config.json" \
  --data "$DATA" --seq-len 16 --global-batch 2 --steps 1
echo "test_json_limits: ok"
