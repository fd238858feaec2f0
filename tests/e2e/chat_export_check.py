"""A chat model through import, fine-tuning on chat data and export (issue 55, item 7), for
tests/e2e/test_chat_data.sh.

    python chat_export_check.py make TOKDIR OUT            a Hugging Face model directory
    python chat_export_check.py craft CKPT PREFIX KIND...  copies PREFIX-KIND.h5 of a checkpoint, edited
    python chat_export_check.py check SRC TPL EXPORT SFT_EXPORT BIN CKPT SFT_CKPT

make: OUT gets TOKDIR's tokenizer files and ChatML template (tests/e2e/chat_make.py's chatml: the
template ends each turn with <|im_end|>), with the tokenizer's eos and config.json's bos / eos set
to <|endoftext|> (as a base model has them, e.g. Qwen2.5: the end of turn is not the eos), a
generation_config.json with eos_token_id [<|endoftext|>, <|end_header_id|>] and keys of its own
(it does not know <|im_end|>), and weights written with numpy alone that make the Llama a bigram
machine: every o_proj and down_proj is zero, so the last hidden state is the current token's
embedding, a unit vector of its class, and lm_head maps the class to the next token: after any
ordinary token X, after X Y, after Y <|im_end|>, after <|im_end|> X again (logit margin 56, which
a fine-tune at a learning rate of 1e-7 does not move). Greedy decoding after a generation prompt
therefore writes X Y <|im_end|> X Y <|im_end|> ... until something stops it.

craft KIND, on the checkpoint's group /tokenizer (docs/checkpoint-format.md) with h5py, resealed with ckpt_meta.py:
  eot_bad       end_of_turn_ids [700] (the tokenizer's vocab_size is 600)
  eot_vocab     info vocab_size 1000 and end_of_turn_ids [700]: within the record, outside the model
  gen_bad       generation_config.json replaced by {"pad_token_id": -1} (CRC32 in info updated)

check, against transformers (the reference). EXPORT is SRC imported and exported; SFT_EXPORT the
export of SRC fine-tuned on chat data tokenized with template TPL (SRC's tokenizer, another template):
  * both exports' tokenizer files are SRC's bytes; EXPORT's chat_template.jinja is SRC's and
    SFT_EXPORT's is TPL's (the data's template); AutoTokenizer of each renders a conversation
    (apply_chat_template, generation prompt) to SRC's ids;
  * the fine-tune's checkpoint records end_of_turn_ids [<|im_end|>] (h5py);
  * GenerationConfig.from_pretrained: EXPORT keeps SRC's keys and eos list; SFT_EXPORT's eos list is
    eos, <|im_end|>, then SRC's other id, its other keys kept; config.json keeps the eos alone;
  * AutoModelForCausalLM.generate (greedy, max_new_tokens 20) on the rendered prompt stops after
    X Y <|im_end|> on SFT_EXPORT and runs all 20 tokens on EXPORT (nothing there names <|im_end|>);
  * shardtrain's --mode generate (BIN) likewise: new ids X, Y on SFT_CKPT, 20 ids on CKPT.
"""

import json
import os
import shutil
import subprocess
import sys
import zlib

import numpy as np

HIDDEN, LAYERS, HEADS, INTER, VOCAB = 32, 1, 2, 64, 600
GEN_EXTRA = {"max_new_tokens": 24, "repetition_penalty": 1.0, "transformers_version": "5.24.0"}


def special_ids(tokdir):
    tj = json.load(open(os.path.join(tokdir, "tokenizer.json"), encoding="utf-8"))
    return {t["content"]: t["id"] for t in tj["added_tokens"]}


def picks(tokdir):
    """(<|endoftext|>, <|im_end|>, <pad>, <|end_header_id|>, X, Y): X and Y two ordinary tokens."""
    sp = special_ids(tokdir)
    return sp["<|endoftext|>"], sp["<|im_end|>"], sp["<pad>"], sp["<|end_header_id|>"], 300, 301


def make(tokdir, out):
    from safetensors.numpy import save_file
    os.makedirs(out)
    for f in os.listdir(tokdir):
        shutil.copy(os.path.join(tokdir, f), out)
    text, im_end, pad, other, x, y = picks(tokdir)
    tc = json.load(open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8"))
    tc["eos_token"] = "<|endoftext|>"
    json.dump(tc, open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": HEADS, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "bos_token_id": text, "eos_token_id": text, "torch_dtype": "float32"}
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    gen = {"bos_token_id": text, "eos_token_id": [text, other], "pad_token_id": pad, **GEN_EXTRA}
    json.dump(gen, open(os.path.join(out, "generation_config.json"), "w"), indent=2)
    rng = np.random.default_rng(7)
    cls = np.zeros(VOCAB, dtype=np.int64)  # the class of each token: 0 ordinary, 1 X, 2 Y, 3 <|im_end|>
    cls[x], cls[y], cls[im_end] = 1, 2, 3
    emb = np.zeros((VOCAB, HIDDEN), dtype=np.float32)
    emb[np.arange(VOCAB), cls] = 1.0
    head = np.zeros((VOCAB, HIDDEN), dtype=np.float32)
    for c, nxt in ((0, x), (1, y), (2, im_end), (3, x)):
        head[nxt, c] = 10.0
    t = {"model.embed_tokens.weight": emb, "lm_head.weight": head, "model.norm.weight": np.ones(HIDDEN, np.float32)}
    hd = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        small = lambda *s: (0.02 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
        t.update({p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
                  p + "self_attn.q_proj.weight": small(HEADS * hd, HIDDEN),
                  p + "self_attn.k_proj.weight": small(HEADS * hd, HIDDEN),
                  p + "self_attn.v_proj.weight": small(HEADS * hd, HIDDEN),
                  p + "self_attn.o_proj.weight": np.zeros((HIDDEN, HEADS * hd), np.float32),
                  p + "mlp.gate_proj.weight": small(INTER, HIDDEN), p + "mlp.up_proj.weight": small(INTER, HIDDEN),
                  p + "mlp.down_proj.weight": np.zeros((HIDDEN, INTER), np.float32)})
    save_file(t, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    print(f"ok: made {out}: eos <|endoftext|> {text}, end of turn <|im_end|> {im_end}, bigram X {x} -> Y {y} -> {im_end} -> X")


def craft(ckpt, prefix, kinds):
    for kind in kinds:
        craft_one(ckpt, f"{prefix}-{kind}.h5", kind)


def craft_one(ckpt, out, kind):
    import h5py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ckpt_meta
    shutil.copy(ckpt, out)
    with h5py.File(out, "r+") as f:
        g = f["tokenizer"]
        info = json.loads(g.attrs["info"])
        if kind == "eot_bad":
            info["end_of_turn_ids"] = [700]
        elif kind == "eot_vocab":
            info["vocab_size"], info["end_of_turn_ids"] = 1000, [700]
        elif kind == "gen_bad":
            raw = b'{"pad_token_id": -1}'
            del g["generation_config.json"]
            g.create_dataset("generation_config.json", data=np.frombuffer(raw, dtype=np.uint8))
            info["files"]["generation_config.json"] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
        else:
            sys.exit(f"unknown kind {kind}")
        g.attrs.create("info", json.dumps(info), dtype=h5py.string_dtype("utf-8"))
    ckpt_meta.reseal(out)


def check(src, tpl, exp, sft_exp, binary, ckpt, sft_ckpt):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import h5py
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging
    logging.disable_progress_bar()
    text, im_end, pad, other, x, y = picks(src)
    same = lambda a, b: open(a, "rb").read() == open(b, "rb").read()  # noqa: E731
    for f in ("tokenizer.json", "tokenizer_config.json"):
        for d in (exp, sft_exp):
            assert same(os.path.join(src, f), os.path.join(d, f)), f"{d}/{f} differs from {src}'s"
    assert same(os.path.join(src, "chat_template.jinja"), os.path.join(exp, "chat_template.jinja"))
    assert same(os.path.join(tpl, "chat_template.jinja"), os.path.join(sft_exp, "chat_template.jinja")), \
        "the fine-tune's export does not carry the template its data was rendered with"
    assert not same(os.path.join(src, "chat_template.jinja"), os.path.join(tpl, "chat_template.jinja"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, naïve café?"}]
    want = AutoTokenizer.from_pretrained(src).apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=True)["input_ids"]
    for d in (exp, sft_exp):
        got = AutoTokenizer.from_pretrained(d).apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                   return_dict=True)["input_ids"]
        assert list(got) == list(want), (d, got, want)
    print(f"ok: tokenizer files exported byte for byte; chat_template.jinja: the model's in its import's export, the "
          f"chat data's in the fine-tune's; apply_chat_template on both exports gives the source's {len(want)} ids")
    with h5py.File(sft_ckpt, "r") as f:
        info = json.loads(f["tokenizer"].attrs["info"])
    assert info["end_of_turn_ids"] == [im_end], info
    g = GenerationConfig.from_pretrained(exp)
    assert g.eos_token_id == [text, other] and g.pad_token_id == pad and g.bos_token_id == text, g
    gs = GenerationConfig.from_pretrained(sft_exp)
    assert gs.eos_token_id == [text, im_end, other] and gs.pad_token_id == pad and gs.bos_token_id == text, gs
    for d in (exp, sft_exp):
        raw = json.load(open(os.path.join(d, "generation_config.json")))
        assert all(raw[k] == v for k, v in GEN_EXTRA.items()), (d, raw)
        assert json.load(open(os.path.join(d, "config.json")))["eos_token_id"] == text, d
    print(f"ok: the fine-tune's checkpoint records end_of_turn_ids [{im_end}]; generation_config.json eos_token_id "
          f"[{text}, {other}] as imported, [{text}, {im_end}, {other}] after the chat data, the model's other keys kept "
          f"in both (pad {pad}, max_new_tokens, transformers_version); config.json keeps eos {text} alone")
    ids = torch.tensor([list(want)])
    for d, stop in ((exp, False), (sft_exp, True)):
        new = AutoModelForCausalLM.from_pretrained(d).generate(ids, do_sample=False, max_new_tokens=20)[0, ids.shape[1]:]
        new = new.tolist()
        assert new == ([x, y, im_end] if stop else ([x, y, im_end] * 7)[:20]), (d, new)
    print(f"ok: transformers generate (greedy) stops after X Y <|im_end|> on the fine-tune's export; on the import's "
          f"export, which names no end of turn, it writes all 20 tokens")
    for c, stop in ((ckpt, False), (sft_ckpt, True)):
        r = subprocess.run([binary, "--mode", "generate", c, "--prompt-ids", ",".join(map(str, want)), "--temperature", "0",
                            "--max-new-tokens", "20", "--print-ids"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in (r.stdout + r.stderr).splitlines() if "generate: new ids:" in ln)
        got = [int(v) for v in line.split("new ids:")[1].strip().split(",")]
        assert got == ([x, y] if stop else ([x, y, im_end] * 7)[:20]), (c, got)
    print(f"ok: shardtrain --mode generate likewise: new ids {x},{y} on the fine-tune's checkpoint, 20 on the import")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(*sys.argv[2:4])
    elif cmd == "craft":
        craft(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif cmd == "check":
        check(*sys.argv[2:9])
    else:
        sys.exit(__doc__)
