"""Inputs and checks for tests/e2e/test_llama3_shapes.sh: Llama-3-style shapes (vocab 128256, ids
above 65535 in a u32 token file, head_dim != hidden_size / num_attention_heads, llama3 RoPE
scaling), checked against transformers itself.

Usage:
  llama3_shapes_check.py make WORK
      writes WORK/u32.tok (token_bytes 4, docs/data-format.md), WORK/train.json (a config.json in
      transformers 4.x form: top-level rope_theta + rope_scaling {"type": "llama3"}), WORK/ids.txt
      (the prompt ids, comma-separated, many > 65535), and two Hugging Face directories made by
      transformers for --mode import: WORK/hf_v5 (save_pretrained: rope_parameters) and WORK/hf_v4
      (the same weights, config.json rewritten as Llama 3.1 ships it: rope_theta + rope_scaling).
  llama3_shapes_check.py export WORK
      WORK/hf_export: shardtrain's export of the trained model; WORK/logits_export.bin: shardtrain's
      logits of [BOS] + ids (--dump-logits). Checks config and logits against transformers.
  llama3_shapes_check.py import WORK NAME
      WORK/logits_NAME.bin: shardtrain's logits after importing WORK/NAME; compared with
      transformers' logits of WORK/NAME itself.
Prints "ok: ..." lines; any failure raises.
"""
import io
import json
import logging
import math
import os
import struct
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

V, BOS, EOS = 128256, 128000, 128001
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, MAXPOS = 64, 4, 2, 24, 96, 2, 64
THETA = 10000.0
# original_max_position_embeddings 16 at sequence length 32: with head_dim 24 the wavelengths
# 2*pi*theta^(j/12) run from 6.3 to 29000, so pairs 0-1 are interpolated and pairs 2-11 divided by 8.
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
LOGIT_TOL = 1e-4
work = sys.argv[2]


def write_token_file(path, train, val):
    name = b"test-u32".ljust(16, b"\0")
    head = b"STTOKv1\0" + struct.pack("<6I2Q", 1, V, BOS, EOS, 4, 0, len(train), len(val)) + name
    assert len(head) == 64
    with open(path, "wb") as f:
        f.write(head + np.asarray(list(train) + list(val), dtype="<u4").tobytes())


def make():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = np.random.default_rng(7)
    toks = []
    while len(toks) < 6000:  # documents of 20-200 ids over the whole vocabulary, BOS ... EOS
        n = int(rng.integers(20, 200))
        toks += [BOS] + [int(x) for x in rng.integers(0, V, size=n)] + [EOS]
    n_val = 1000
    write_token_file(f"{work}/u32.tok", toks[:-n_val], toks[-n_val:])
    high = sum(t > 65535 for t in toks)
    assert high > len(toks) // 3 and max(toks) > 120000, (high, max(toks))
    print(f"ok: wrote a u32 token file, {len(toks)} tokens, {high} of them above 65535 (largest {max(toks)})")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": MAXPOS,
           "rms_norm_eps": 1e-5, "rope_theta": THETA, "rope_scaling": {"type": "llama3", **LLAMA3},
           "tie_word_embeddings": True, "bos_token_id": BOS, "eos_token_id": [EOS, 128008, 128009]}
    json.dump(cfg, open(f"{work}/train.json", "w"), indent=1)
    ids = [int(x) for x in rng.integers(0, V, size=30)] + [65535, 65536, V - 1]
    assert sum(i > 65535 for i in ids) >= 10
    open(f"{work}/ids.txt", "w").write(",".join(map(str, ids)))
    # Import sources: transformers' own model and save_pretrained (5.x: rope_parameters) ...
    torch.manual_seed(11)
    hc = LlamaConfig(vocab_size=V, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                     max_position_embeddings=MAXPOS, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     bos_token_id=BOS, eos_token_id=EOS,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3})
    m = LlamaForCausalLM(hc)
    m.save_pretrained(f"{work}/hf_v5", safe_serialization=True)
    saved = json.load(open(f"{work}/hf_v5/config.json"))
    assert saved["rope_parameters"]["rope_type"] == "llama3" and saved["head_dim"] == HEAD_DIM, saved
    # ... and the same weights with config.json as Llama 3.1 ships it (transformers 4.x form).
    m.save_pretrained(f"{work}/hf_v4", safe_serialization=True)
    c4 = dict(saved)
    del c4["rope_parameters"]
    c4["rope_theta"] = 500000.0
    c4["rope_scaling"] = {"rope_type": "llama3", **LLAMA3}
    json.dump(c4, open(f"{work}/hf_v4/config.json", "w"), indent=1)
    print("ok: made HF directories hf_v5 (rope_parameters) and hf_v4 (rope_theta + rope_scaling), head_dim 24")


from hf_capture import load_checked as load  # noqa: E402 (this directory is on sys.path: the script's own)


def hf_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def prompt():
    return [BOS] + [int(x) for x in open(f"{work}/ids.txt").read().split(",")]


def compare(model, logits_file, what):
    ids = prompt()
    ours = np.fromfile(logits_file, dtype="<f4")
    assert ours.size == len(ids) * model.config.vocab_size, (ours.size, len(ids), model.config.vocab_size)
    ours = ours.reshape(len(ids), -1)
    theirs = hf_logits(model, ids)
    err = float(np.abs(ours - theirs).max())
    assert err <= LOGIT_TOL, f"{what}: max |logit difference| {err:.3e} > {LOGIT_TOL}"
    print(f"ok: {what}: transformers' fp32 logits of {len(ids)} ids ({sum(i > 65535 for i in ids)} above 65535) "
          f"equal shardtrain's, max abs difference {err:.2e}")
    return ours


def check_export():
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    d = f"{work}/hf_export"
    cfg = json.load(open(f"{d}/config.json"))
    want_rp = {"rope_type": "llama3", "rope_theta": THETA, **LLAMA3}
    assert cfg["head_dim"] == HEAD_DIM and cfg["rope_parameters"] == want_rp, cfg
    assert cfg["rope_theta"] == THETA and cfg["rope_scaling"] == {"rope_type": "llama3", **LLAMA3}, cfg
    model = load(d)
    mc = model.config
    assert mc.head_dim == HEAD_DIM and dict(mc.rope_parameters) == want_rp, (mc.head_dim, mc.rope_parameters)
    assert mc.vocab_size == V and mc.eos_token_id == [EOS, 128008, 128009] and mc.bos_token_id == BOS
    attn = model.model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (HEADS * HEAD_DIM, HIDDEN), attn.q_proj.weight.shape
    assert tuple(attn.k_proj.weight.shape) == (KV_HEADS * HEAD_DIM, HIDDEN)
    assert tuple(attn.o_proj.weight.shape) == (HIDDEN, HEADS * HEAD_DIM)
    print(f"ok: export config.json: head_dim {HEAD_DIM} (q_proj [{HEADS * HEAD_DIM}, {HIDDEN}]), rope_parameters "
          f"{want_rp}; transformers loads it without warnings and reads the same")
    # The rotary frequencies transformers uses are llama3's, and they differ from plain RoPE's.
    inv, factor = ROPE_INIT_FUNCTIONS["llama3"](mc, "cpu")
    plain = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    assert factor == 1.0 and torch.allclose(model.model.rotary_emb.inv_freq.double(), inv.double())
    changed = int((inv.double() / plain - 1).abs().gt(1e-3).sum())
    assert changed >= HEAD_DIM // 2 - 2, f"llama3 scaling changes only {changed} of {HEAD_DIM // 2} frequencies"
    # shardtrain's rope_inv_freqs, in float64 as documented in config.h, against transformers' float32 values.
    ours = []
    for j, f in enumerate(plain.tolist()):
        wl = 2 * math.pi / f
        lo, hi = LLAMA3["original_max_position_embeddings"] / LLAMA3["low_freq_factor"], \
            LLAMA3["original_max_position_embeddings"] / LLAMA3["high_freq_factor"]
        if wl < hi:
            ours.append(f)
        elif wl > lo:
            ours.append(f / LLAMA3["factor"])
        else:
            s = (LLAMA3["original_max_position_embeddings"] / wl - LLAMA3["low_freq_factor"]) / \
                (LLAMA3["high_freq_factor"] - LLAMA3["low_freq_factor"])
            ours.append((1 - s) * f / LLAMA3["factor"] + s * f)
    assert np.allclose(np.array(ours), inv.double().numpy(), rtol=2e-6, atol=0), (ours, inv)
    print(f"ok: llama3 scaling changes {changed} of {HEAD_DIM // 2} rotary frequencies at original_max 16")
    ours_logits = compare(model, f"{work}/logits_export.bin", "export")
    # The same weights with plain RoPE give other logits: the scaling is what makes them equal.
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": THETA}
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    plain_err = float(np.abs(ours_logits - hf_logits(model, prompt())).max())
    assert plain_err > 10 * LOGIT_TOL, f"plain RoPE gives the same logits (max difference {plain_err:.2e})"
    print(f"ok: with plain RoPE instead, transformers' logits differ by up to {plain_err:.2e}")


def check_import(name):
    compare(load(f"{work}/{name}"), f"{work}/logits_{name}.bin", f"import of {name}")


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make()
    elif sys.argv[1] == "export":
        import torch
        torch.set_num_threads(2)
        check_export()
    elif sys.argv[1] == "import":
        import torch
        torch.set_num_threads(2)
        check_import(sys.argv[3])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
