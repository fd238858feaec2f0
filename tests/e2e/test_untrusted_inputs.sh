#!/usr/bin/env bash
# Files from strangers (issue 27), each item with the smallest input that shows it:
#  1. a tokenizer.model whose precompiled_charsmap trie points past its blob (libsentencepiece
#     loads it and crashes in encode) is refused, naming the file and the field: by import, by
#     prepare, and by generate when a checkpoint carries it; Llama-style (identity), NFKC and
#     custom-rule models still load and encode exactly as Python's sentencepiece does;
#  2. an index naming a file outside the model directory (absolute, '..', a symbolic link out) is
#     refused naming the path, and no byte of that file reaches the output;
#  3. a safetensors shape whose element count overflows ([2^62, 4]) is refused;
#  4. --mode inspect refuses unvalidated metadata (resealed so the checksums pass);
#  5. a param_table row whose numel is wrong is reported by that field's name.
source "$(dirname "$0")/common.sh"
META=$ROOT/tests/e2e/ckpt_meta.py
DATA=$WORK/c.tok
head -c 60000 /usr/share/games/fortunes/fortunes >"$WORK/big.txt"
"$BIN" --mode prepare --input "$WORK/big.txt" --out "$DATA" >/dev/null
TRAIN=(--data "$DATA" --seq-len 16 --global-batch 2 --eval-batches 1 --threads 1)

# ---- 1. SentencePiece models -------------------------------------------------------------------
"$BIN" --mode tokenizer --input "$WORK/big.txt" --vocab-size 400 --out "$WORK/identity.model" >/dev/null
"$PY" - "$WORK" <<'PY'
import struct, sys, sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb
w = sys.argv[1]
common = dict(input=f"{w}/big.txt", vocab_size=400, model_type="bpe", byte_fallback=True, minloglevel=2)
spm.SentencePieceTrainer.train(model_prefix=f"{w}/nfkc", normalization_rule_name="nmt_nfkc", **common)
open(f"{w}/rules.tsv", "w").write("41\t61\n42 43\t62\n")  # A -> a, BC -> b: a custom table, not a builtin one
spm.SentencePieceTrainer.train(model_prefix=f"{w}/custom", normalization_rule_tsv=f"{w}/rules.tsv", **common)
# The crash of the issue: the identity model with a charsmap of one trie unit whose offset leads far
# past the trie (a 9-byte blob).
m = pb.ModelProto()
m.ParseFromString(open(f"{w}/identity.model", "rb").read())
m.normalizer_spec.precompiled_charsmap = struct.pack("<II", 4, 0x7FFFFC00) + b"\0"
open(f"{w}/crafted.model", "wb").write(m.SerializeToString())
text = "Hello  Ｗｏｒｌｄ ABC ﬁ ①, déjà vu"
open(f"{w}/t.txt", "w").write(text)
for name in ["identity", "nfkc", "custom"]:
    sp = spm.SentencePieceProcessor(model_file=f"{w}/{name}.model")
    open(f"{w}/{name}.ids", "w").write(" ".join(map(str, [sp.bos_id()] + sp.encode(text) + [sp.eos_id()])) + "\n")
PY
for name in identity nfkc custom; do
  "$BIN" --mode prepare --tokenizer "$WORK/$name.model" --input "$WORK/t.txt" --out "$WORK/$name.tok" \
    >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name: a valid SentencePiece model is refused"; }
  "$PY" - "$WORK/$name.tok" "$WORK/$name.ids" <<'PY' || fail "$name: ids differ from Python's sentencepiece"
import struct, sys
b = open(sys.argv[1], "rb").read()
want = list(map(int, open(sys.argv[2]).read().split()))
# docs/data-format.md: token size at byte 24, train/val counts at 32, tokens from byte 64.
tb, (n_train, n_val) = struct.unpack_from("<I", b, 24)[0], struct.unpack_from("<2Q", b, 32)
got = list(struct.unpack_from(f"<{n_train + n_val}{'H' if tb == 2 else 'I'}", b, 64))
assert got == want, (got, want)
PY
  echo "ok: $name SentencePiece model loads; its ids equal Python sentencepiece's"
done
expect_fail sp_prepare "'$WORK/crafted.model': field 'normalizer_spec.precompiled_charsmap' (normalizer 'identity', 9 bytes) has a trie node (unit 0) whose children lie beyond its 1 units" 1 \
  --mode prepare --tokenizer "$WORK/crafted.model" --input "$WORK/t.txt" --out "$WORK/x.tok"
# Import: a model whose vocabulary holds the 400 ids, with the crafted model as tokenizer.model.
printf '{"vocab_size": 512, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}\n' >"$WORK/m.json"
"$BIN" --model "$WORK/m.json" "${TRAIN[@]}" --steps 1 --checkpoint-dir "$WORK/ck2" >/dev/null
"$BIN" --mode export "$WORK/ck2/step_00000001.h5" --out "$WORK/hf_sp" >/dev/null
rm -f "$WORK"/hf_sp/tokenizer*.json "$WORK/hf_sp/special_tokens_map.json"
cp -r "$WORK/hf_sp" "$WORK/hf_crafted"
cp "$WORK/nfkc.model" "$WORK/hf_sp/tokenizer.model"
cp "$WORK/crafted.model" "$WORK/hf_crafted/tokenizer.model"
expect_fail sp_import "'$WORK/hf_crafted/tokenizer.model': field 'normalizer_spec.precompiled_charsmap'" 2 \
  --mode import --hf-dir "$WORK/hf_crafted" --out "$WORK/x.h5"
"$BIN" --mode import --hf-dir "$WORK/hf_sp" --out "$WORK/sp.h5" >/dev/null || fail "an NFKC tokenizer.model is refused by import"
"$BIN" --mode generate "$WORK/sp.h5" --prompt "Ｈello" --max-new-tokens 1 >/dev/null || fail "generate with an NFKC tokenizer"
# A checkpoint that carries the crafted model (written there by hand, checksums resealed): generate refuses.
cp "$WORK/sp.h5" "$WORK/sp_crafted.h5"
"$PY" - "$WORK/sp_crafted.h5" "$WORK/crafted.model" <<'PY'
import json, sys, zlib, h5py, numpy as np
path, model = sys.argv[1], open(sys.argv[2], "rb").read()
with h5py.File(path, "r+") as f:
    g = f["tokenizer"]
    info = json.loads(g.attrs["info"])
    del g["tokenizer.model"]
    g.create_dataset("tokenizer.model", data=np.frombuffer(model, dtype=np.uint8))
    info["files"]["tokenizer.model"].update(bytes=len(model), crc32=zlib.crc32(model))
    g.attrs.create("info", json.dumps(info), dtype=h5py.string_dtype("utf-8"))
PY
"$PY" "$META" reseal "$WORK/sp_crafted.h5"
expect_fail sp_generate "checkpoint '$WORK/sp_crafted.h5' (tokenizer.model)': field 'normalizer_spec.precompiled_charsmap'" 2 \
  --mode generate "$WORK/sp_crafted.h5" --prompt "Hello" --max-new-tokens 1

# ---- 2. index naming files outside the directory ----------------------------------------------------
"$BIN" --model tiny "${TRAIN[@]}" --steps 1 --checkpoint-dir "$WORK/ck" >/dev/null
CK=$WORK/ck/step_00000001.h5
"$BIN" --mode export "$CK" --out "$WORK/hf" >/dev/null
printf '12345678' >"$WORK/secret"  # 8 bytes: as a header length, 4050765991979987505
for way in abs dotdot link; do
  cp -r "$WORK/hf" "$WORK/hf_$way"
  case $way in
    abs) target=$WORK/secret ;;
    dotdot) target=../secret ;;
    link) ln -s "$WORK/secret" "$WORK/hf_$way/shard.safetensors"; target=shard.safetensors ;;
  esac
  "$PY" - "$WORK/hf_$way" "$target" <<'PY'
import json, sys
from safetensors import safe_open
d, target = sys.argv[1], sys.argv[2]
with safe_open(f"{d}/model.safetensors", "np") as f:
    names = list(f.keys())
json.dump({"metadata": {}, "weight_map": {n: target for n in names}}, open(f"{d}/model.safetensors.index.json", "w"))
PY
  rm "$WORK/hf_$way/model.safetensors"
  want=$([ "$way" = link ] && echo "names 'shard.safetensors', a symbolic link to '$(realpath "$WORK/secret")', outside of directory" \
         || { [ "$way" = abs ] && echo "names '$target', an absolute path outside of directory" || echo "names '$target', a path with '..'"; })
  expect_fail "index_$way" "index '$WORK/hf_$way/model.safetensors.index.json' (key 'weight_map') $want" 2 \
    --mode import --hf-dir "$WORK/hf_$way" --out "$WORK/x.h5"
  ! grep -q 4050765991979987505 "$WORK/index_$way.log" || fail "index_$way: the secret's bytes reached the output"
done

# The Hugging Face hub cache (huggingface_hub's layout): every file of a snapshot is a symbolic link
# to ../../blobs/<sha256>. That is inside the model's own cache folder: it imports, and the weights
# are those of the plain directory; a snapshot link to anywhere else is still refused.
HUB=$WORK/hub/models--org--tiny
mkdir -p "$HUB/blobs" "$HUB/snapshots/0123abcd"
for f in "$WORK"/hf/*; do
  sha=$(sha256sum "$f" | cut -d' ' -f1)
  cp "$f" "$HUB/blobs/$sha"
  ln -s "../../blobs/$sha" "$HUB/snapshots/0123abcd/$(basename "$f")"
done
"$BIN" --mode import --hf-dir "$HUB/snapshots/0123abcd" --out "$WORK/hub.h5" >"$WORK/hub.log" 2>&1 \
  || { cat "$WORK/hub.log"; fail "hub: a hub-cache snapshot (links to ../../blobs) was refused"; }
"$BIN" --mode import --hf-dir "$WORK/hf" --out "$WORK/plain.h5" >/dev/null
"$BIN" --mode export "$WORK/hub.h5" --out "$WORK/hub_re" >/dev/null && "$BIN" --mode export "$WORK/plain.h5" --out "$WORK/plain_re" >/dev/null
cmp "$WORK/hub_re/model.safetensors" "$WORK/plain_re/model.safetensors" || fail "hub: imported weights differ from the plain directory's"
ln -sfn "$WORK/secret" "$HUB/snapshots/0123abcd/model.safetensors"
expect_fail hub_out "names 'model.safetensors', a symbolic link to '$(realpath "$WORK/secret")', outside of directory" 2 \
  --mode import --hf-dir "$HUB/snapshots/0123abcd" --out "$WORK/x.h5"
echo "ok: a hub-cache snapshot (links to ../../blobs) imports the same weights; a snapshot link elsewhere is refused"

# ---- 3. element count overflow -----------------------------------------------------------------------
cp -r "$WORK/hf" "$WORK/hf_overflow"
"$PY" - "$WORK/hf_overflow/model.safetensors" <<'PY'
import json, struct, sys
p = sys.argv[1]
b = open(p, "rb").read()
n = struct.unpack_from("<Q", b)[0]
h = json.loads(b[8:8 + n])
end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
h["x.rotary_emb.inv_freq"] = {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [end, end]}  # 2^64 elements: 0 bytes if wrapped
hs = json.dumps(h).encode()
hs += b" " * (-len(hs) % 8)
open(p, "wb").write(struct.pack("<Q", len(hs)) + hs + b[8 + n:])
PY
expect_fail st_overflow "tensor 'x.rotary_emb.inv_freq': the element count of its shape overflows 64 bits" 1 \
  --mode import --hf-dir "$WORK/hf_overflow" --out "$WORK/x.h5"

# ---- 4, 5. inspect validates what it prints; a wrong numel is named --------------------------------
"$PY" - "$CK" "$WORK" "$META" <<'PY'
import json, shutil, subprocess, sys
import h5py, numpy as np
good, work, meta = sys.argv[1:4]
def variant(name, edit):
    p = f"{work}/i_{name}.h5"
    shutil.copy(good, p)
    with h5py.File(p, "r+") as f:
        edit(f)
    subprocess.run([sys.executable, meta, "reseal", p], check=True)
def config(change):
    def edit(f):
        c = f.attrs["model_config"]
        f.attrs.create("model_config", change(c), dtype=h5py.string_dtype("utf-8"))
    return edit
def setkey(k, v):
    return config(lambda c: json.dumps({**json.loads(c), k: v}))
def row(unit, i, field, value):
    def edit(f):
        t = f[f"units/{unit}/param_table"]
        rows = t[:]
        if callable(value):
            value(rows[i])
        else:
            rows[i][field] = value
        t[...] = rows
    return edit
variant("truncated_config", config(lambda c: c[: len(c) // 2]))
variant("vocab0", setkey("vocab_size", 0))
variant("hidden_huge", setkey("hidden_size", 2**64 - 1))
variant("numel_huge", row("model.layers.0", 0, "numel", 2**63 - 1))
# A dense checkpoint whose config claims experts (issue 56's keys): refused, never read as dense.
variant("claims_moe", config(lambda c: json.dumps({**json.loads(c), "architecture": "MixtralForCausalLM",
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": json.loads(c)["intermediate_size"],
    "norm_topk_prob": True, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False})))
def neg(r): r["shape"][0] = -r["shape"][0]
variant("negative_shape", row("model.layers.0", 0, None, neg))
variant("dotdot_name", row("model.layers.0", 0, "name", b"../../x"))
variant("duplicate_name", row("model.layers.0", 1, "name", b"model.norm.weight"))  # a name of another unit
def numel_minus(r): r["numel"] -= 1
variant("numel_wrong", row("model.layers.0", 1, None, numel_minus))
PY
unit_row() { "$PY" -c 'import h5py,sys; r=h5py.File(sys.argv[1])["units/model.layers.0/param_table"][int(sys.argv[2])]; print(r["name"].decode(), r["offset"], r["numel"])' "$CK" "$1"; }
read -r N0 O0 E0 <<<"$(unit_row 0)"
read -r N1 O1 E1 <<<"$(unit_row 1)"
expect_fail inspect_truncated_config "checkpoint '$WORK/i_truncated_config.h5': attribute 'model_config': canonical model config is malformed" 1 --mode inspect "$WORK/i_truncated_config.h5"
expect_fail inspect_vocab0 "Invalid model config in checkpoint '$WORK/i_vocab0.h5' (attribute 'model_config'): key 'vocab_size' must be positive, got 0" 1 --mode inspect "$WORK/i_vocab0.h5"
expect_fail inspect_hidden_huge "canonical model config is malformed: key 'hidden_size' = 18446744073709551615 is out of range" 1 --mode inspect "$WORK/i_hidden_huge.h5"
expect_fail inspect_claims_moe "attribute 'model_config' is a mixture-of-experts model's, which format version 7 holds, but attribute 'format_version' is 3" 1 --mode inspect "$WORK/i_claims_moe.h5"
expect_fail export_claims_moe "attribute 'model_config' is a mixture-of-experts model's, which format version 7 holds" 1 --mode export "$WORK/i_claims_moe.h5" --out "$WORK/x_moe"
expect_fail inspect_numel_huge "unit 'model.layers.0': tensor '$N0' (offset $O0, numel 9223372036854775807 in 'param_table') lies outside the unit" 1 --mode inspect "$WORK/i_numel_huge.h5"
expect_fail inspect_negative_shape "tensor '$N0' has shape [-" 1 --mode inspect "$WORK/i_negative_shape.h5"
expect_fail inspect_dotdot_name "unit 'model.layers.0' holds tensor '../../x', which this model does not have" 1 --mode inspect "$WORK/i_dotdot_name.h5"
expect_fail inspect_duplicate_name "unit 'model.layers.0' holds tensor 'model.norm.weight', which this model does not have" 1 --mode inspect "$WORK/i_duplicate_name.h5"
want="tensor '$N1' has numel $((E1 - 1)) in the file (dataset 'param_table' of unit 'model.layers.0'), expected $E1"
expect_fail inspect_numel_wrong "$want" 1 --mode inspect "$WORK/i_numel_wrong.h5"
expect_fail export_numel_wrong "$want" 2 --mode export "$WORK/i_numel_wrong.h5" --out "$WORK/exp"
"$BIN" --mode inspect "$CK" >/dev/null || fail "inspect refuses the good checkpoint"
echo "ok: inspect refuses every unvalidated variant and still reads the good checkpoint"
