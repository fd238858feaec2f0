#!/usr/bin/env bash
# Special token ids against the data (issue 11, item 5). The reference is the token file's own
# header (bos_id, eos_id at bytes 16 and 20, docs/data-format.md), read here with od:
#  * training fills ids a config.json leaves out from the token file, with a note; the checkpoint,
#    its export's config.json and the export's tokenizer ("<s>", "</s>") carry the header's ids;
#  * a config whose bos / eos (one id, or a list without the file's eos) conflicts with the token file
#    is refused on every rank, naming both; a list that contains the file's eos trains;
#  * import keeps absent ids unset; with --data it fills them from (or refuses a conflict with) the
#    token file as training does;
#  * export fills unset ids from the token file the checkpoint records (root attribute `data`) and
#    refuses a conflict with it; with nothing to fill from, config.json says null, no tokenizer is
#    written, and generate refuses naming bos_token_id; a model whose ids are bytes (1 / 2) gets no
#    tokenizer (never "<s>" / "</s>" on byte ids), and an earlier export's tokenizer files are removed.
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
read -r VOCAB BOS EOS < <(od -An -tu4 -j12 -N12 "$DATA")
[ "$BOS" -ge 256 ] && [ "$EOS" -ge 256 ] || fail "unexpected token file header: bos $BOS, eos $EOS"

cfg() {  # name json-fragment: a small Llama config.json plus the fragment's keys
  cat >"$WORK/$1.json" <<J
{"architectures": ["LlamaForCausalLM"], "vocab_size": $VOCAB, "hidden_size": 32, "intermediate_size": 48,
 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
 "tie_word_embeddings": false$2}
J
}
TRAIN=(--data "$DATA" --seq-len 16 --global-batch 6 --steps 1 --threads 1)  # 2 and 3 ranks
run() {  # name command...: must succeed; output in $WORK/name.log
  local name=$1
  shift
  timeout -k 5 120 "$@" >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name"; }
}
has() {  # name text: the log of `name` contains text
  grep -qF -- "$2" "$WORK/$1.log" || { cat "$WORK/$1.log"; fail "$1: output lacks '$2'"; }
}

# ---- Training: absent ids come from the token file ----
cfg noids ""
run train_noids $MPIRUN -np 2 "$BIN" --model "$WORK/noids.json" "${TRAIN[@]}" --checkpoint-dir "$WORK/ck"
has train_noids "note: model config '$WORK/noids.json' has no bos_token_id; using $BOS, the bos_id of token file '$DATA'"
has train_noids "note: model config '$WORK/noids.json' has no eos_token_id; using $EOS, the eos_id of token file '$DATA'"
CK=$WORK/ck/step_00000001.h5
run inspect_trained "$BIN" --mode inspect "$CK"
has inspect_trained "\"bos_token_id\":$BOS,"
has inspect_trained "\"eos_token_id\":$EOS,"
run export_trained "$BIN" --mode export "$CK" --out "$WORK/hf_trained"
echo "ok: training with a config.json without bos/eos took $BOS/$EOS from the token file (notes; checkpoint; exported)"

# ---- Training: conflicts are refused on every rank ----
cfg bos1 ', "bos_token_id": 1'
cfg eos2 ', "eos_token_id": 2'
cfg eoslist ', "eos_token_id": [1, 2]'
expect_fail train_bos_conflict "model config '$WORK/bos1.json' has bos_token_id 1, but token file '$DATA' has bos_id $BOS: they must agree" \
  3 --model "$WORK/bos1.json" "${TRAIN[@]}"
expect_fail train_eos_conflict "model config '$WORK/eos2.json' has eos_token_id 2, but token file '$DATA' has eos_id $EOS: they must agree" \
  3 --model "$WORK/eos2.json" "${TRAIN[@]}"
expect_fail train_eos_list_conflict "model config '$WORK/eoslist.json' has eos_token_id [1,2], but token file '$DATA' has eos_id $EOS, which is not in the list" \
  3 --model "$WORK/eoslist.json" "${TRAIN[@]}"
cfg eoslist_ok ", \"bos_token_id\": $BOS, \"eos_token_id\": [10, $EOS]"
run train_eos_list_ok $MPIRUN -np 2 "$BIN" --model "$WORK/eoslist_ok.json" "${TRAIN[@]}" --checkpoint-dir "$WORK/ck_list"
# No note about the special ids (other notes, e.g. OpenBLAS's on a user's OPENBLAS_CORETYPE, may appear).
! grep -E "^note: .*(bos|eos)_(token_)?id" "$WORK/train_eos_list_ok.log" || fail "train_eos_list_ok: a note for ids that agree"
# Its export: the token file's eos (not the list's first, the byte 10) is "</s>" and the pad id.
run export_eos_list_ok "$BIN" --mode export "$WORK/ck_list/step_00000001.h5" --out "$WORK/hf_list"
"$PY" - "$WORK/hf_list" "$EOS" <<'PY' || fail "export of an eos list led by a byte id"
import json, sys
d, eos = sys.argv[1], int(sys.argv[2])
tok = json.load(open(f"{d}/tokenizer.json"))
ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
assert ids["</s>"] == eos, ids
gen = json.load(open(f"{d}/generation_config.json"))
assert gen["pad_token_id"] == eos and sorted(gen["eos_token_id"]) == sorted([10, eos]), gen
print(f"ok: eos_token_id [10, {eos}]: the export's '</s>' and pad id are the token file's {eos}, both stop ids kept")
PY
echo "ok: an eos list containing the token file's eos ($EOS) trains, without a note"

# ---- Import: absent ids stay unset; --data fills them or refuses a conflict ----
# Hugging Face directories from the trained export: one without the ids, one with Llama's 1 / 2.
"$PY" - "$WORK" <<'PY' || fail "making HF directories"
import json, shutil, sys
w = sys.argv[1]
for name, ids in (("hf_noids", {}), ("hf_llama_ids", {"bos_token_id": 1, "eos_token_id": 2})):
    shutil.copytree(f"{w}/hf_trained", f"{w}/{name}",  # weights and config only: these test the ids,
                    ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))  # not the tokenizer
    c = json.load(open(f"{w}/{name}/config.json"))
    c.pop("bos_token_id"), c.pop("eos_token_id")
    c.update(ids)
    json.dump(c, open(f"{w}/{name}/config.json", "w"))
PY
run import_noids $MPIRUN -np 2 "$BIN" --mode import --hf-dir "$WORK/hf_noids" --out "$WORK/noids.h5"
run inspect_noids "$BIN" --mode inspect "$WORK/noids.h5"
has inspect_noids '"bos_token_id":null,"eos_token_id":null,'
run import_noids_data $MPIRUN -np 2 "$BIN" --mode import --hf-dir "$WORK/hf_noids" --out "$WORK/noids_data.h5" --data "$DATA"
has import_noids_data "note: model config '$WORK/hf_noids/config.json' has no bos_token_id; using $BOS, the bos_id of token file '$DATA'"
run inspect_noids_data "$BIN" --mode inspect "$WORK/noids_data.h5"
has inspect_noids_data "\"bos_token_id\":$BOS,\"eos_token_id\":$EOS,"
has inspect_noids_data "data {\"bos_id\":$BOS,\"eos_id\":$EOS,\"path\":\"$DATA\",\"tokenizer\":\"byte-level\""  # recorded for export
expect_fail import_conflict "model config '$WORK/hf_llama_ids/config.json' has bos_token_id 1, but token file '$DATA' has bos_id $BOS" \
  2 --mode import --hf-dir "$WORK/hf_llama_ids" --out "$WORK/x.h5" --data "$DATA"
[ ! -e "$WORK/x.h5" ] || fail "a refused import left a checkpoint behind"
run import_llama_ids "$BIN" --mode import --hf-dir "$WORK/hf_llama_ids" --out "$WORK/llama_ids.h5"
echo "ok: import keeps absent ids unset (null), fills them with --data, refuses 1 vs $BOS with --data"

# ---- Export and generate ----
# Unset ids, nothing to fill them from: null in config.json, no tokenizer, generate refuses.
run export_noids "$BIN" --mode export "$WORK/noids.h5" --out "$WORK/out_noids"
has export_noids "has no bos_token_id or eos_token_id and records no token file to take them from"
has export_noids "note: no tokenizer written to '$WORK/out_noids': the model has no bos_token_id"
expect_fail generate_no_bos "the model config has no bos_token_id" 2 --mode generate "$WORK/noids.h5" --prompt hi --max-new-tokens 1
# Ids 1 / 2 (bytes of the byte-level tokenizer): no tokenizer, and an earlier export's is removed.
cp -r "$WORK/hf_trained" "$WORK/out_llama_ids"
run export_llama_ids "$BIN" --mode export "$WORK/llama_ids.h5" --out "$WORK/out_llama_ids"
has export_llama_ids "records no token file, and its bos_token_id 1 / eos_token_id 2 are not the byte-level tokenizer's (256 / 257)"
# The token file the checkpoint records (root attribute `data`, written by h5py as training does):
# it fills unset ids, and a conflict with it is refused.
"$PY" - "$WORK" "$DATA" "$VOCAB" "$BOS" "$EOS" "$ROOT/tests/e2e" <<'PY' || fail "writing the data attribute"
import h5py, json, shutil, sys
sys.path.insert(0, sys.argv[6])
import ckpt_meta
w, path, vocab, bos, eos = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
rec = json.dumps({"path": path, "tokenizer": "byte-level", "vocab_size": vocab, "bos_id": bos, "eos_id": eos})
for src in ("noids", "llama_ids"):
    shutil.copy(f"{w}/{src}.h5", f"{w}/{src}_rec.h5")
    with h5py.File(f"{w}/{src}_rec.h5", "r+") as f:
        f.attrs["data"] = rec
    ckpt_meta.reseal(f"{w}/{src}_rec.h5")  # a deliberate edit: the metadata checksums must follow
PY
run export_noids_rec $MPIRUN -np 2 "$BIN" --mode export "$WORK/noids_rec.h5" --out "$WORK/out_noids_rec"
has export_noids_rec "note: the model config of checkpoint '$WORK/noids_rec.h5' has no bos_token_id; using $BOS, the bos_id of token file '$DATA'"
expect_fail export_conflict "the model config of checkpoint '$WORK/llama_ids_rec.h5' has bos_token_id 1, but token file '$DATA' (which checkpoint '$WORK/llama_ids_rec.h5' was trained on) has bos_id $BOS" \
  2 --mode export "$WORK/llama_ids_rec.h5" --out "$WORK/out_x"
[ ! -e "$WORK/out_x/config.json" ] || fail "a refused export wrote config.json"
expect_fail generate_conflict "has bos_token_id 1, but token file '$DATA'" 2 --mode generate "$WORK/llama_ids_rec.h5" --prompt hi --max-new-tokens 1

# What the exports hold, read by transformers and by the JSON files themselves.
"$PY" - "$WORK" "$BOS" "$EOS" <<'PY' || fail "checking the exports"
import json, logging, os, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import AutoTokenizer
import transformers
transformers.logging.set_verbosity_error()
w, bos, eos = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
def cfg(d, f="config.json"):
    return json.load(open(f"{w}/{d}/{f}"))
for d in ("hf_trained", "out_noids_rec"):  # ids from the token file, tokenizer on them
    for f in ("config.json", "generation_config.json"):
        c = cfg(d, f)
        assert (c["bos_token_id"], c["eos_token_id"]) == (bos, eos), f"{d}/{f}: {c['bos_token_id']}, {c['eos_token_id']}"
    tok = AutoTokenizer.from_pretrained(f"{w}/{d}")
    assert (tok.bos_token_id, tok.eos_token_id) == (bos, eos), f"{d}: tokenizer <s> {tok.bos_token_id}, </s> {tok.eos_token_id}"
    assert tok("ab")["input_ids"] == [bos, 97, 98], tok("ab")["input_ids"]
    special = set(tok.all_special_ids)
    assert not special & set(range(256)), f"{d}: special ids {sorted(special)} among the bytes"
    assert tok.decode([1, 2]) == "\x01\x02", f"{d}: ids 1, 2 decode as {tok.decode([1, 2])!r}"
print(f"ok: exports of the trained checkpoint and of an unset-id checkpoint recording its token file: config.json, "
      f"generation_config.json and the tokenizer's <s>/</s> are the token file's {bos}/{eos}; ids 1, 2 are bytes")
c = cfg("out_noids")
assert c["bos_token_id"] is None and c["eos_token_id"] is None, c
assert cfg("out_noids", "generation_config.json")["bos_token_id"] is None
for d in ("out_noids", "out_llama_ids"):
    left = [f for f in TOKENIZER_FILES if os.path.exists(f"{w}/{d}/{f}")]
    assert not left, f"{d}: tokenizer files {left}"
assert (cfg("out_llama_ids")["bos_token_id"], cfg("out_llama_ids")["eos_token_id"]) == (1, 2)
print("ok: unset ids export as null; exports with unset ids or ids 1 / 2 hold no tokenizer files (an earlier one removed)")
PY
