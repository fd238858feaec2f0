"""Checks of shardtrain's Hugging Face exports, by transformers, tokenizers and safetensors themselves.

Usage: hf_export_check.py --edge-values CKPT OUT: copies checkpoint CKPT to OUT with rounding edge cases
(ties to even for bf16 and fp16, fp16 subnormals and overflow) written into EDGE_PARAM, CRC32s updated,
by the documented layout (docs/checkpoint-format.md).

Usage: hf_export_check.py WORK PROMPT, after test_hf_export.sh has written in WORK:
  corpus.tok           the token file every case trained on (its header gives BOS and EOS)
  CASE.json            the training config of CASE (tied, untied, gqa, v300)
  hf_CASE/             its fp32 export at world size 1
  logits_CASE_TAG.bin  shardtrain's float32 logits [T, V] (--mode generate --max-new-tokens 0 --dump-logits)
                       of [bos] + the UTF-8 bytes of PROMPTS[TAG] (PROMPT, "ROMEO:", "")
  hf_untied_bf16/, hf_untied_fp16/   bf16 / fp16 exports of the untied checkpoint
  hf_untied_sharded/   its fp32 export with --max-shard-size 20KB, at 2 ranks
  hf_edge_fp32/, hf_edge_bf16/, hf_edge_fp16/   exports of the --edge-values copy of the untied checkpoint
Prints one "ok: ..." line per property; any failure raises (non-zero exit).
"""
import glob
import io
import json
import logging
import math
import os
import shutil
import struct
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

EDGE_PARAM = "model.layers.0.mlp.up_proj.weight"


def edge_values():
    """float32 values where rounding to bf16 / fp16 is easy to get wrong."""
    bits = []
    for hi in (0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0001, 0x0080, 0x7F7F):  # bf16 halfway: even and odd, +-, tiny, max
        bits.append(hi << 16 | 0x8000)
    for hi in (0x3F80, 0x3F81):  # just below and above halfway
        bits += [hi << 16 | 0x7FFF, hi << 16 | 0x8001]
    for m in (0x000000, 0x002000, 0x7FE000):  # fp16 halfway (13 dropped bits = 0x1000), even / odd / carry
        bits += [0x3F800000 | m | 0x1000, 0xBF800000 | m | 0x1000]
    v = np.array(bits, dtype="<u4").view("<f4")
    more = [65504.0, 65519.0, 65519.996, 65520.0, 70000.0, -65520.0, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25,
            3 * 2.0 ** -25, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25, 5 * 2.0 ** -26, 6.0e-8, -0.0, 1e-30, 3.0e38, -3.0e38]
    return np.concatenate([v, np.array(more, dtype="<f4")])


if len(sys.argv) == 4 and sys.argv[1] == "--edge-values":
    import zlib

    import h5py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ckpt_meta

    shutil.copy(sys.argv[2], sys.argv[3])
    written = 0
    with h5py.File(sys.argv[3], "r+") as f:
        W = int(f.attrs["world_size"])
        for u in f["units"].values():
            for row in u["param_table"][:]:
                if row["name"].decode() != EDGE_PARAM:
                    continue
                off, S, v = int(row["offset"]), int(u.attrs["shard_size"]), edge_values()
                assert v.size <= int(row["numel"])
                flat = u["params"][:]
                flat[off:off + v.size] = v
                u["params"][:] = flat
                crc = u["shard_crc32"][:]
                for r in range(W):
                    crc[r, 0] = zlib.crc32(flat[r * S:(r + 1) * S].astype("<f4").tobytes())
                u["shard_crc32"][:] = crc
                written = v.size
    if not written:
        sys.exit(f"{EDGE_PARAM} not found in {sys.argv[2]}")
    ckpt_meta.reseal(sys.argv[3])  # the metadata checksums cover shard_crc32
    print(f"ok: wrote {written} rounding edge values into {EDGE_PARAM} of a copy of the checkpoint")
    sys.exit(0)

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

WORK, PROMPT = sys.argv[1], sys.argv[2]
PROMPTS = {"prompt": PROMPT, "romeo": "ROMEO:", "empty": ""}  # as test_hf_export.sh dumps them
# The special ids of the token file (docs/data-format.md: u32 vocab_size, bos_id, eos_id at offset 12).
with open(f"{WORK}/corpus.tok", "rb") as f:
    TOK_VOCAB, BOS, EOS = struct.unpack("<3I", f.read(24)[12:24])
CASES = ["tied", "untied", "gqa", "v300"]
LOGIT_TOL = 1e-4
SHARD_BYTES = 20_000  # --max-shard-size 20KB (decimal, as transformers)

torch.set_num_threads(2)
transformers.logging.set_verbosity_warning()
transformers.logging.disable_progress_bar()

ST_DTYPES = {"F32": (4, "<f4", torch.float32), "BF16": (2, "<u2", torch.bfloat16), "F16": (2, "<u2", torch.float16)}


def fail(msg):
    raise AssertionError(msg)


from hf_capture import Captured  # noqa: E402 (this directory is on sys.path: the script's own)


def load_model(path, dtype=torch.float32):
    """Loads with transformers; returns (model, loading info, captured log text)."""
    with Captured() as cap:
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=dtype)
    model.eval()
    return model, info, cap.text


def assert_clean_load(name, info, log):
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if len(info.get(k, [])) != 0:
            fail(f"{name}: transformers reports {k} = {sorted(info[k])}")
    if "newly initialized" in log or "LOAD REPORT" in log:
        fail(f"{name}: transformers logged a load report:\n{log}")


def strict_safetensors(path, want_dtype=None):
    """Parses one file by the format spec alone; returns {name: (dtype, shape, raw bytes)}."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) == size
    if size < 8:
        fail(f"{path}: {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if not 2 <= n <= size - 8:
        fail(f"{path}: header length {n} does not fit in a {size}-byte file")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"{path}: header is not UTF-8 JSON ({e})")
    if not isinstance(header, dict):
        fail(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta != {"format": "pt"}:
        fail(f"{path}: __metadata__ is {meta!r}, expected {{'format': 'pt'}}")
    if not header:
        fail(f"{path}: no tensors")
    entries = []
    for name, e in header.items():
        if set(e) != {"dtype", "shape", "data_offsets"}:
            fail(f"{path}: tensor {name} has keys {sorted(e)}")
        if e["dtype"] not in ST_DTYPES:
            fail(f"{path}: tensor {name} has dtype {e['dtype']}")
        if want_dtype is not None and e["dtype"] != want_dtype:
            fail(f"{path}: tensor {name} is {e['dtype']}, expected {want_dtype}")
        shape = e["shape"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            fail(f"{path}: tensor {name} has shape {shape!r}")
        b, end = e["data_offsets"]
        if not (isinstance(b, int) and isinstance(end, int)):
            fail(f"{path}: tensor {name} has offsets {e['data_offsets']!r}")
        want = ST_DTYPES[e["dtype"]][0] * math.prod(shape)
        if end - b != want:
            fail(f"{path}: tensor {name} spans {end - b} bytes, dtype x shape {e['dtype']} {shape} needs {want}")
        entries.append((b, end, name, e["dtype"], tuple(shape)))
    entries.sort()
    pos = 0
    for b, end, name, _, _ in entries:
        if b != pos:
            fail(f"{path}: tensor {name} starts at {b}, previous tensor ended at {pos} ({'gap' if b > pos else 'overlap'})")
        pos = end
    if size != 8 + n + pos:
        fail(f"{path}: file has {size} bytes, expected 8 + {n} + {pos} = {8 + n + pos}")
    base = 8 + n
    return {name: (dt, shape, raw[base + b:base + end]) for b, end, name, dt, shape in entries}


def as_torch(dt, shape, data):
    _, np_dtype, tdt = ST_DTYPES[dt]
    a = np.frombuffer(data, dtype=np_dtype).copy()
    t = torch.from_numpy(a.view(np.int16) if dt != "F32" else a)
    return (t.view(tdt) if dt != "F32" else t).reshape(shape)


def export_files(d):
    return sorted(glob.glob(os.path.join(d, "*.safetensors")))


def read_export(d, want_dtype=None):
    """All tensors of an export, each file checked strictly; a name in two files is an error."""
    out = {}
    for p in export_files(d):
        for name, v in strict_safetensors(p, want_dtype).items():
            if name in out:
                fail(f"{d}: tensor {name} appears in two files")
            out[name] = v
    return out


def expected_tensors(cfg):
    """Name -> shape of a LlamaForCausalLM of this config."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = H // nh
    t = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                  p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                  p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                  p + "mlp.down_proj.weight": (H, I)})
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = (V, H)
    return t


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def generate_ids(text):
    """The ids `shardtrain --mode generate` feeds for a prompt: BOS, then the UTF-8 bytes."""
    return [BOS] + list(text.encode("utf-8"))


def load_tokenizer(path):
    with Captured():  # long texts exceed model_max_length (64): transformers warns, as it should
        return AutoTokenizer.from_pretrained(path)


prompt_ids = generate_ids(PROMPT)
T = len(prompt_ids)
all_export_dirs = []

# ---- 1. Each config: load cleanly, logits equal shardtrain's, head and vocab as configured ----
fp32 = {}
for case in CASES:
    d = f"{WORK}/hf_{case}"
    all_export_dirs.append(d)
    train_cfg = json.load(open(f"{WORK}/{case}.json"))
    cfg = json.load(open(f"{d}/config.json"))
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
              "rope_theta", "rms_norm_eps", "architectures"):
        if k in train_cfg and cfg.get(k) != train_cfg[k]:
            fail(f"{case}: config.json {k} = {cfg.get(k)!r}, trained with {train_cfg[k]!r}")
    if cfg.get("model_type") != "llama" or cfg.get("dtype") != "float32":
        fail(f"{case}: config.json model_type {cfg.get('model_type')!r}, dtype {cfg.get('dtype')!r}")
    if os.path.exists(f"{d}/model.safetensors.index.json") or export_files(d) != [f"{d}/model.safetensors"]:
        fail(f"{case}: expected one model.safetensors and no index, found {os.listdir(d)}")
    tensors = read_export(d, "F32")
    fp32[case] = tensors
    want = expected_tensors(cfg)
    got = {n: v[1] for n, v in tensors.items()}
    if got != want:
        fail(f"{case}: tensors differ from a LlamaForCausalLM of config.json: "
             f"missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}, "
             f"shapes {[(n, got[n], want[n]) for n in set(got) & set(want) if got[n] != want[n]]}")
    tied = cfg["tie_word_embeddings"]
    if tied == ("lm_head.weight" in tensors):
        fail(f"{case}: tie_word_embeddings {tied} but lm_head.weight {'present' if not tied else 'absent'}")
    rows = tensors["model.embed_tokens.weight"][1][0]
    if rows != cfg["vocab_size"] or (not tied and tensors["lm_head.weight"][1][0] != rows):
        fail(f"{case}: config.json vocab_size {cfg['vocab_size']}, embedding rows {rows}")

    model, info, log = load_model(d)
    assert_clean_load(case, info, log)
    if model.config.vocab_size != rows or model.config.tie_word_embeddings != tied:
        fail(f"{case}: transformers config vocab {model.config.vocab_size}, tied {model.config.tie_word_embeddings}")
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    if tied != (emb.data_ptr() == head.data_ptr()):
        fail(f"{case}: transformers' lm_head {'is not' if tied else 'is'} the embedding")
    sd = model.state_dict()
    for n, (dt, shape, data) in tensors.items():  # what transformers holds is what the file holds
        if not torch.equal(sd[n], as_torch(dt, shape, data)):
            fail(f"{case}: transformers' {n} differs from the file's")
    if tied and not torch.equal(head, as_torch(*tensors["model.embed_tokens.weight"])):
        fail(f"{case}: tied lm_head differs from the file's embedding")

    # The export's tokenizer feeds the model what `--mode generate` feeds it, and the logits agree.
    tok = load_tokenizer(d)
    diffs = {}
    for tag, text in PROMPTS.items():
        ids = tok(text)["input_ids"]
        if ids != generate_ids(text):
            fail(f"{case}: AutoTokenizer ids of {text!r} are {ids}, --mode generate feeds {generate_ids(text)}")
        raw = np.fromfile(f"{WORK}/logits_{case}_{tag}.bin", dtype="<f4")
        if raw.size != len(ids) * rows:
            fail(f"{case}: dumped logits of {text!r} hold {raw.size} floats, expected T x V = {len(ids)} x {rows}")
        mine = torch.from_numpy(raw.reshape(len(ids), rows))
        theirs = hf_logits(model, ids)
        if theirs.shape != mine.shape:
            fail(f"{case}: transformers logits {tuple(theirs.shape)}, shardtrain {tuple(mine.shape)}")
        diff = (theirs - mine).abs().max().item()
        if not torch.isfinite(mine).all() or not diff <= LOGIT_TOL:
            bad = (theirs - mine).abs().max(dim=1).values
            fail(f"{case}: {text!r}: max |logit diff| {diff:.3e} > {LOGIT_TOL} (per position: {bad.tolist()})")
        spread = (mine.max(dim=1).values - mine.min(dim=1).values).min().item()
        if not spread > 100 * LOGIT_TOL:  # the comparison would be vacuous on near-constant logits
            fail(f"{case}: {text!r}: logits nearly constant (min row range {spread:.2e})")
        diffs[tag] = diff
        if tag == "prompt":
            fp32[case] = (tensors, model, theirs)
    diff = max(diffs.values())
    print(f"ok: {case}: {len(tensors)} tensors (lm_head.weight {'absent, tied' if tied else 'present, untied'}), "
          f"vocab_size {cfg['vocab_size']} = embedding rows, H {cfg['hidden_size']}, heads {cfg['num_attention_heads']}/"
          f"{cfg['num_key_value_heads']} KV; transformers loads with no missing/unexpected/mismatched keys or "
          f"'newly initialized' log; AutoTokenizer ids == --mode generate's (BOS {BOS} + UTF-8 bytes) for "
          f"{len(PROMPTS)} prompts (ROMEO:, empty, {T - 1} bytes), logits [T, {rows}] on them max |diff| {diff:.2e}")

# The log capture sees a real report: the untied export without lm_head.weight.
ctrl = f"{WORK}/control_no_head"
shutil.copytree(f"{WORK}/hf_untied", ctrl)
with safe_open(f"{ctrl}/model.safetensors", framework="pt") as f:
    sd = {k: f.get_tensor(k) for k in f.keys() if k != "lm_head.weight"}
save_file(sd, f"{ctrl}/model.safetensors", metadata={"format": "pt"})
_, info, log = load_model(ctrl)
if "lm_head.weight" not in info["missing_keys"] or "newly initialized" not in log:
    fail(f"control: dropping lm_head.weight went unnoticed (missing {info['missing_keys']}, log {log!r})")
# ... and the strict parser rejects a trailing byte.
with open(f"{ctrl}/model.safetensors", "ab") as f:
    f.write(b"\0")
try:
    strict_safetensors(f"{ctrl}/model.safetensors")
except AssertionError as e:
    if "expected 8 +" not in str(e):
        raise
else:
    fail("control: strict check accepted a trailing byte")
print("ok: controls: a missing lm_head.weight is reported (missing_keys and 'newly initialized' captured); "
      "a trailing byte fails the strict safetensors check")

# ---- 2. Tokenizer and pipeline ----
texts = ["Hello, world!", "café naïve Grüße Ærøskøbing", "日本語のテキスト，中文", "emoji 🙂🎉👍🏽 and 🇫🇷",
         "line one\nline two\r\n\tindented\t", "   three leading spaces", " one", "<s>", "</s>", "<s>hi</s>",
         "  <s> </s>\n", "", "".join(chr(i) for i in range(128)), "ñ" * 30 + "€𝄞", PROMPT]
for case in CASES:
    d = f"{WORK}/hf_{case}"
    tok = load_tokenizer(d)
    raw_tok = Tokenizer.from_file(f"{d}/tokenizer.json")  # the file alone, without transformers ...
    raw_tok.encode_special_tokens = True  # ... but as tokenizer_config.json's split_special_tokens asks
    with Captured():
        ids_of = {t: (tok(t)["input_ids"], tok.encode(t), tok(t, add_special_tokens=False)["input_ids"],
                      raw_tok.encode(t).ids) for t in texts}
    if (tok.bos_token_id, tok.eos_token_id, tok.bos_token, tok.eos_token) != (BOS, EOS, "<s>", "</s>"):
        fail(f"{case}: tokenizer bos/eos {tok.bos_token!r} {tok.bos_token_id} / {tok.eos_token!r} {tok.eos_token_id}, "
             f"the token file has {BOS} / {EOS}")
    for t in texts:
        bare = list(t.encode("utf-8"))
        ids, ids2, ids_bare, ids_raw = ids_of[t]
        if ids != [BOS] + bare or ids2 != ids or ids_raw != ids:
            fail(f"{case}: tokenizer ids of {t!r}: {ids[:20]}... (encode {ids2[:20]}..., tokenizers {ids_raw[:20]}...), "
                 f"expected BOS {BOS} + UTF-8 bytes {bare[:20]}...")
        if ids_bare != bare:
            fail(f"{case}: tokenizer ids of {t!r} with add_special_tokens=False: {ids_bare[:20]}..., expected {bare[:20]}...")
        for seq, want in ((bare, t), (ids, "<s>" + t), ([BOS] + bare + [EOS], "<s>" + t + "</s>")):
            if tok.decode(seq) != want:
                fail(f"{case}: decode of {seq[:20]}... gave {tok.decode(seq)!r}, expected {want!r}")
            if tok.decode(seq, skip_special_tokens=True) != t:
                fail(f"{case}: decode of {seq[:20]}... without specials gave {tok.decode(seq, skip_special_tokens=True)!r}")
    pair = tok("ab", "cd")["input_ids"]
    if pair != [BOS, 97, 98, BOS, 99, 100]:
        fail(f"{case}: pair ids {pair}, expected BOS + a + BOS + b as transformers' own Llama templates")
nbytes = sum(len(t.encode()) for t in texts)
print(f"ok: AutoTokenizer ({type(tok).__name__}) of all 4 exports and tokenizers' Tokenizer.from_file: {len(texts)} texts "
      f"({nbytes} bytes: accents, CJK, emoji, \\n\\r\\t, leading spaces, literal <s> and </s>, all 128 ASCII codes) give "
      f"ids == BOS + UTF-8 bytes (the bytes alone with add_special_tokens=False); decode round-trips; <s> {BOS} / </s> "
      f"{EOS} special, as the token file's header says")

gen_prompt = "The fortune says:"
with Captured():
    pipe = pipeline("text-generation", model=f"{WORK}/hf_tied", device="cpu")
    out = pipe(gen_prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
text = out[0]["generated_text"]
if not (isinstance(text, str) and text.startswith(gen_prompt) and len(text) > len(gen_prompt)):
    fail(f"pipeline: generated {out!r}")
print(f"ok: pipeline('text-generation') on the tied export generated {len(text) - len(gen_prompt)} chars after "
      f"{gen_prompt!r}: {text[len(gen_prompt):]!r}")

# ---- 3. bf16 / fp16: torch's round-to-nearest-even of the fp32 export, bitwise ----
# Of the trained untied checkpoint, and of its copy with rounding edge cases (hf_edge_*).
for base, ref_dir, prefix in (("untied", "hf_untied", "hf_untied"), ("edge", "hf_edge_fp32", "hf_edge")):
    ref_tensors = read_export(f"{WORK}/{ref_dir}", "F32")
    ref_cfg = json.load(open(f"{WORK}/{ref_dir}/config.json"))
    if base == "edge":
        all_export_dirs.append(f"{WORK}/{ref_dir}")
        ev = torch.from_numpy(edge_values())
        if not torch.equal(as_torch(*ref_tensors[EDGE_PARAM]).flatten()[:ev.numel()].view(torch.int32), ev.view(torch.int32)):
            fail("edge: the fp32 export does not hold the edge values written into the checkpoint")
        for n, v in ref_tensors.items():  # everything else is the trained checkpoint's
            if n != EDGE_PARAM and v != fp32["untied"][0][n]:
                fail(f"edge: {n} differs from the untied export's")
    for tag, st, tdt, name in (("bf16", "BF16", torch.bfloat16, "bfloat16"), ("fp16", "F16", torch.float16, "float16")):
        d = f"{WORK}/{prefix}_{tag}"
        all_export_dirs.append(d)
        cfg = json.load(open(f"{d}/config.json"))
        if cfg.get("dtype") != name or cfg.get("torch_dtype", name) != name:
            fail(f"{d}: config.json dtype {cfg.get('dtype')!r}, torch_dtype {cfg.get('torch_dtype')!r}, expected {name}")
        rest = {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}
        if rest != {k: v for k, v in ref_cfg.items() if k not in ("dtype", "torch_dtype")}:
            fail(f"{d}: config.json differs from the fp32 export's beyond the dtype")
        for fn in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if open(f"{d}/{fn}", "rb").read() != open(f"{WORK}/{ref_dir}/{fn}", "rb").read():
                fail(f"{d}: {fn} differs from the fp32 export's")
        tensors = read_export(d, st)
        if set(tensors) != set(ref_tensors):
            fail(f"{d}: tensor names differ from the fp32 export's")
        n = rounded_up = small = 0
        for k, (dt, shape, data) in tensors.items():
            ref = as_torch(*ref_tensors[k])
            got = as_torch(dt, shape, data)
            want = ref.to(tdt)
            if got.shape != ref.shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                i = tuple((got.view(torch.int16) != want.view(torch.int16)).nonzero()[0].tolist())
                fail(f"{d}: {k}{list(i)}: file has {got[i].item()!r} (0x{got.view(torch.int16)[i].item() & 0xFFFF:04x}), "
                     f"torch rounds {ref[i].item()!r} (0x{ref.view(torch.int32)[i].item() & 0xFFFFFFFF:08x}) to "
                     f"{want[i].item()!r} (0x{want.view(torch.int16)[i].item() & 0xFFFF:04x})")
            n += ref.numel()
            if tdt == torch.bfloat16:  # how often nearest-even differs from truncation
                rounded_up += int(((ref.view(torch.int32) >> 16).to(torch.int16) != got.view(torch.int16)).sum())
            else:
                small += int(((ref.abs() < 2.0 ** -14) & (ref != 0)).sum())  # fp16 subnormal range
        model, info, log = load_model(d, dtype="auto")
        assert_clean_load(d, info, log)
        if model.dtype != tdt:
            fail(f"{d}: transformers loads it (dtype='auto') as {model.dtype}")
        extra = (f"{rounded_up} of them differ from truncation" if tdt == torch.bfloat16
                 else f"{small} in fp16's subnormal range")
        what = "trained untied checkpoint" if base == "untied" else \
            f"copy with {edge_values().size} edge values (halfway ties, fp16 subnormals, overflow to inf)"
        print(f"ok: {tag} of the {what}: {len(tensors)} tensors, {n} values bitwise equal to the fp32 export "
              f".to(torch.{name}) ({extra}); config.json dtype {cfg['dtype']}; dtype='auto' loads as {model.dtype}, "
              f"no missing keys")
ref_tensors = fp32["untied"][0]

# ---- 4. Sharded export ----
d = f"{WORK}/hf_untied_sharded"
all_export_dirs.append(d)
if os.path.exists(f"{d}/model.safetensors"):
    fail("sharded: a model.safetensors sits beside the shards")
index = json.load(open(f"{d}/model.safetensors.index.json"))
files = [os.path.basename(p) for p in export_files(d)]
nf = len(files)
if nf < 2 or files != [f"model-{i:05d}-of-{nf:05d}.safetensors" for i in range(1, nf + 1)]:
    fail(f"sharded: files {files}")
per_file = {fn: strict_safetensors(f"{d}/{fn}", "F32") for fn in files}
where = {n: fn for fn, ts in per_file.items() for n in ts}
if sum(len(ts) for ts in per_file.values()) != len(where):
    fail("sharded: a tensor appears in two files")
if index.get("weight_map") != where:
    fail(f"sharded: weight_map {index.get('weight_map')} does not match the files' headers {where}")
data_bytes = {fn: sum(len(v[2]) for v in ts.values()) for fn, ts in per_file.items()}
total = sum(data_bytes.values())
if index.get("metadata", {}).get("total_size") != total or total != sum(4 * math.prod(v[1]) for v in ref_tensors.values()):
    fail(f"sharded: metadata.total_size {index.get('metadata')}, tensor bytes {total}")
for fn, b in data_bytes.items():
    if b > SHARD_BYTES and len(per_file[fn]) > 1:
        fail(f"sharded: {fn} holds {b} bytes in {len(per_file[fn])} tensors, over the 20KB limit")
if set(where) != set(ref_tensors):
    fail("sharded: tensor names differ from the unsharded export's")
for n, (dt, shape, data) in ((n, v) for ts in per_file.values() for n, v in ts.items()):
    if (dt, shape, data) != ref_tensors[n]:
        fail(f"sharded: {n} differs from the unsharded export's")
for fn in ("config.json", "tokenizer.json", "generation_config.json"):
    if open(f"{d}/{fn}", "rb").read() != open(f"{WORK}/hf_untied/{fn}", "rb").read():
        fail(f"sharded: {fn} differs from the unsharded export's")
model, info, log = load_model(d)
assert_clean_load("sharded", info, log)
sharded_logits = hf_logits(model, prompt_ids)
ref_logits = fp32["untied"][2]
sdiff = (sharded_logits - ref_logits).abs().max().item()
if not torch.equal(sharded_logits, ref_logits):
    fail(f"sharded: logits differ from the unsharded export's (max |diff| {sdiff:.3e})")
print(f"ok: sharded (20KB, 2 ranks): {nf} files of {sorted(data_bytes.values())} data bytes, index total_size {total} "
      f"= sum of tensor bytes, weight_map covers all {len(where)} tensors; loads cleanly, logits equal the unsharded "
      f"export's (max |diff| {sdiff:.1e})")

# safe_open opens every file of every export, and reads what the strict parser read.
nfiles = ntensors = 0
for ed in all_export_dirs:
    for p in export_files(ed):
        parsed = strict_safetensors(p)
        with safe_open(p, framework="pt") as f:
            if set(f.keys()) != set(parsed) or f.metadata() != {"format": "pt"}:
                fail(f"{p}: safe_open sees keys {sorted(f.keys())}, metadata {f.metadata()}")
            for k in f.keys():
                t = f.get_tensor(k)
                mine = as_torch(*parsed[k])
                if t.dtype != mine.dtype or not torch.equal(t.view(torch.uint8), mine.contiguous().view(torch.uint8)):
                    fail(f"{p}: safe_open's {k} differs from the bytes at its offsets")
                ntensors += 1
        nfiles += 1
print(f"ok: strict format check of all {nfiles} .safetensors files in {len(all_export_dirs)} exports (8-byte LE header "
      f"length, JSON header, __metadata__ format pt, offsets contiguous from 0, sizes = dtype x shape, no trailing "
      f"bytes); safe_open opens each and its {ntensors} tensors equal the parsed bytes")
