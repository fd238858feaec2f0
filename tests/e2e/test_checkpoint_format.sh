#!/usr/bin/env bash
# Checkpoint layout, read by independent clients, with a unit smaller than the world size.
# Model: hidden 6 (model.norm has 6 elements: over 4 ranks the last rank's shard is all padding).
#  * saved at 4 ranks; every parameter gathered by shardtrain at 4, 3 and 1 ranks is bitwise equal;
#  * h5py rebuilds every parameter from the documented layout (docs/checkpoint-format.md), checks the
#    shard tables and CRC32s, and matches shardtrain's gathered tensors bitwise;
#  * h5dump alone (binary dump of a flat dataset, cut by the param table's offset) matches too.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
cat >"$WORK/six.json" <<'J'
{"architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 6, "intermediate_size": 5,
 "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1, "max_position_embeddings": 32,
 "tie_word_embeddings": true, "bos_token_id": 256, "eos_token_id": 257}
J
timeout -k 5 120 $MPIRUN -np 4 "$BIN" --model "$WORK/six.json" --data "$DATA" --seq-len 16 --global-batch 8 --steps 3 \
  --threads 1 --checkpoint-dir "$WORK/ck" >"$WORK/train.log" 2>&1 || { cat "$WORK/train.log"; fail "training at 4 ranks"; }
CK=$WORK/ck/step_00000003.h5
[ -f "$CK" ] || fail "no checkpoint at step 3"
timeout -k 5 60 $MPIRUN -np 2 "$BIN" --mode inspect "$CK" >"$WORK/inspect.log" 2>&1 || { cat "$WORK/inspect.log"; fail "inspect"; }
grep -q "step 3, tokens_seen 384, world_size 4" "$WORK/inspect.log" || fail "inspect: step/world size line"
grep -A6 "unit model.norm: numel 6, shard_size 2, padded_numel 8" "$WORK/inspect.log" | grep -q "rank 3: start 6, valid 0, padding 2" \
  || { cat "$WORK/inspect.log"; fail "inspect: model.norm shard table"; }
echo "ok: inspect shows model.norm's rank 3 holding only padding"

PARAMS=$("$PY" -c 'import h5py,sys; f=h5py.File(sys.argv[1]); print(" ".join(r["name"].decode() for u in f["units"].values() for r in u["param_table"][:]))' "$CK")
for np in 4 3 1; do
  timeout -k 5 60 $MPIRUN -np $np "$BIN" --mode inspect "$CK" --dump-param all --dump-out "$WORK/np$np" \
    >"$WORK/dump.log" 2>&1 || { cat "$WORK/dump.log"; fail "dump all at $np ranks"; }
  for p in $PARAMS; do mv "$WORK/np$np/$p.bin" "$WORK/np$np.$p.bin" || fail "no $p at $np ranks"; done
done
# One parameter by name, as before: the same bytes.
timeout -k 5 60 $MPIRUN -np 2 "$BIN" --mode inspect "$CK" --dump-param model.norm.weight --dump-out "$WORK/one.bin" \
  >"$WORK/dump.log" 2>&1 || { cat "$WORK/dump.log"; fail "dump model.norm.weight"; }
cmp -s "$WORK/one.bin" "$WORK/np4.model.norm.weight.bin" || fail "--dump-param NAME differs from --dump-param all"
for p in $PARAMS; do
  cmp -s "$WORK/np4.$p.bin" "$WORK/np3.$p.bin" || fail "$p gathered at 3 ranks differs from 4 ranks"
  cmp -s "$WORK/np4.$p.bin" "$WORK/np1.$p.bin" || fail "$p gathered at 1 rank differs from 4 ranks"
done
echo "ok: $(echo $PARAMS | wc -w) parameters gathered at 4, 3 and 1 ranks are bitwise equal"

"$PY" - "$CK" "$WORK" "$ROOT/tests/e2e" <<'PY'
import sys, zlib, json
import h5py, numpy as np
path, work = sys.argv[1], sys.argv[2]
f = h5py.File(path, "r")
assert f.attrs["format"] == "shardtrain-checkpoint" and f.attrs["format_version"] == 3
sys.path.insert(0, sys.argv[3])
import ckpt_meta
assert ckpt_meta.problems(path) == [], ckpt_meta.problems(path)  # the metadata checksums, from the documented layout
W = int(f.attrs["world_size"]); assert W == 4
cfg = json.loads(f.attrs["model_config"]); assert cfg["hidden_size"] == 6
n = 0
for name, u in f["units"].items():
    numel, S = int(u.attrs["numel"]), int(u.attrs["shard_size"])
    assert int(u.attrs["padded_numel"]) == S * W == u["params"].shape[0]
    table, crcs = u["shard_table"][:], u["shard_crc32"][:]
    assert table.shape == (W, 3)
    for r in range(W):
        start, valid, pad = table[r]
        assert start == r * S and valid + pad == S and valid == max(0, min(S, numel - r * S)), (name, r, table[r])
        for k, ds in enumerate(["params", "adam_m", "adam_v"]):
            sl = u[ds][r * S:(r + 1) * S]
            assert zlib.crc32(sl.astype("<f4").tobytes()) == crcs[r, k], (name, ds, r)
            assert np.all(sl[valid:] == 0), "padding must be zero"
    flat = u["params"][:]
    for row in u["param_table"][:]:
        pname, off, cnt = row["name"].decode(), int(row["offset"]), int(row["numel"])
        shape = tuple(int(d) for d in row["shape"][: int(row["ndim"])])
        w = flat[off:off + cnt].reshape(shape)
        mine = np.fromfile(f"{work}/np4.{pname}.bin", dtype="<f4").reshape(shape)
        assert np.array_equal(w, mine), pname
        n += 1
norm = f["units/model.norm/shard_table"][:]
assert list(norm[3]) == [6, 0, 2], norm
print(f"ok: h5py rebuilt {n} parameters from the documented layout, bitwise equal; shard tables, CRC32s and metadata checksums verified")
PY

# h5dump alone: binary dump of one flat dataset, cut at the param table's offset.
h5dump -d "/units/model.layers.1/params" -b LE -o "$WORK/l1.bin" "$CK" >/dev/null || fail "h5dump"
h5dump -d "/units/model.layers.1/param_table" "$CK" >"$WORK/pt.txt"
off=$(grep -A3 '"model.layers.1.mlp.up_proj.weight"' "$WORK/pt.txt" | sed -n '2p' | tr -dc '0-9')
cnt=$(grep -A3 '"model.layers.1.mlp.up_proj.weight"' "$WORK/pt.txt" | sed -n '3p' | tr -dc '0-9')
[ "$cnt" = 30 ] || { cat "$WORK/pt.txt"; fail "h5dump param_table: numel of up_proj is '$cnt', expected 30"; }
tail -c +$((off * 4 + 1)) "$WORK/l1.bin" | head -c $((cnt * 4)) >"$WORK/up_h5dump.bin"
cmp "$WORK/up_h5dump.bin" "$WORK/np1.model.layers.1.mlp.up_proj.weight.bin" || fail "h5dump slice differs from shardtrain's tensor"
echo "ok: h5dump's bytes of model.layers.1.mlp.up_proj.weight (offset $off) equal shardtrain's gathered tensor"
