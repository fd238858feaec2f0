"""Inputs and checks for tests/e2e/test_qwen3.sh: transformers' Qwen3ForCausalLM (Llama with an
RMSNorm over each head's query and key before RoPE) against shardtrain.

Usage:
  qwen3_check.py make WORK
      WORK/qwen3 (untied) and WORK/qwen3_tied: tiny Qwen3ForCausalLM models made and saved by
      transformers (head_dim 16 != hidden_size / heads = 12, GQA 4:2, q_norm / k_norm weights set
      away from their init of ones so that they matter); WORK/ids.txt: the prompt ids.
  qwen3_check.py logits WORK DIR LOGITS
      transformers' fp32 logits of [BOS] + ids for the model in WORK/DIR against shardtrain's
      (--dump-logits file WORK/LOGITS), within 1e-5; and the same weights without the q/k norm
      (transformers' Llama) give logits that differ, so the comparison sees the norm.
  qwen3_check.py export WORK SRC OUT
      shardtrain's export WORK/OUT of the import of WORK/SRC: every tensor bitwise equal (the
      q_norm / k_norm weights included), config.json says Qwen3ForCausalLM / qwen3, and
      transformers loads it without warnings.
Prints "ok: ..." lines; any failure raises.
"""
import glob
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

V, BOS, EOS = 300, 256, 257
LOGIT_TOL = 1e-5
COMMON = dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
              rope_theta=1000000.0, bos_token_id=BOS, eos_token_id=EOS)
work = sys.argv[2]


def make():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    for name, seed, tied in (("qwen3", 0, False), ("qwen3_tied", 1, True)):
        torch.manual_seed(seed)
        m = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=tied, **COMMON))
        with torch.no_grad():
            for layer in m.model.layers:  # away from ones: per-element scales the logits depend on
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.copy_(1 + 0.5 * torch.randn_like(norm.weight))
        m.save_pretrained(f"{work}/{name}", safe_serialization=True)
        cfg = json.load(open(f"{work}/{name}/config.json"))
        assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3", cfg
    rng = np.random.default_rng(3)
    open(f"{work}/ids.txt", "w").write(",".join(str(int(x)) for x in rng.integers(0, V, size=40)))
    print("ok: made Qwen3ForCausalLM directories qwen3 (untied) and qwen3_tied with transformers")


from hf_capture import load_checked  # noqa: E402 (this directory is on sys.path: the script's own)


def load(path):
    model = load_checked(path)
    assert type(model).__name__ == "Qwen3ForCausalLM", type(model).__name__
    return model


def prompt():
    return [BOS] + [int(x) for x in open(f"{work}/ids.txt").read().split(",")]


def hf_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def check_logits(name, logits_file):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    model = load(f"{work}/{name}")
    ids = prompt()
    ours = np.fromfile(f"{work}/{logits_file}", dtype="<f4")
    assert ours.size == len(ids) * V, (ours.size, len(ids), V)
    ours = ours.reshape(len(ids), V).astype(np.float64)
    theirs = hf_logits(model, ids)
    err = float(np.abs(ours - theirs).max())
    assert err <= LOGIT_TOL, f"{name}: max |logit difference| {err:.3e} > {LOGIT_TOL}"
    # The same weights in transformers' Llama (no q/k norm): other logits, so the norm is seen.
    c = model.config
    same = {k: v for k, v in COMMON.items() if k != "rope_theta"}
    llama = LlamaForCausalLM(LlamaConfig(**same, rope_parameters=dict(c.rope_parameters), attention_bias=False,
                                         tie_word_embeddings=c.tie_word_embeddings)).eval()
    sd = {k: v for k, v in model.state_dict().items() if "q_norm" not in k and "k_norm" not in k}
    missing, unexpected = llama.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    without = float(np.abs(ours - hf_logits(llama, ids)).max())
    assert without > 100 * LOGIT_TOL, f"{name}: without the q/k norm the logits differ by only {without:.2e}"
    print(f"ok: {name}: transformers' fp32 logits of {len(ids)} ids equal shardtrain's, max abs difference "
          f"{err:.2e} (tolerance {LOGIT_TOL}); without the q/k norm they would differ by {without:.2e}")


def tensors(d):
    from safetensors.torch import load_file
    t = {}
    for f in sorted(glob.glob(f"{d}/*.safetensors")):
        t.update(load_file(f))
    return t


def check_export(src, out):
    import torch
    a, b = tensors(f"{work}/{src}"), tensors(f"{work}/{out}")
    ca, cb = json.load(open(f"{work}/{src}/config.json")), json.load(open(f"{work}/{out}/config.json"))
    if ca.get("tie_word_embeddings"):
        a.pop("lm_head.weight", None)
    assert set(a) == set(b), set(a) ^ set(b)
    norms = [k for k in a if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * COMMON["num_hidden_layers"], norms
    for k in a:
        assert b[k].dtype == torch.float32 and torch.equal(b[k], a[k].float()), f"{k}: not bitwise equal"
    assert cb["architectures"] == ["Qwen3ForCausalLM"] and cb["model_type"] == "qwen3", cb
    for key in ("head_dim", "hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "tie_word_embeddings", "vocab_size"):
        assert ca.get(key) == cb.get(key), f"config {key}: {ca.get(key)} vs {cb.get(key)}"
    load(f"{work}/{out}")
    print(f"ok: {src}: import + export gives its {len(a)} tensors back bitwise ({len(norms)} q/k norm weights), "
          f"config.json Qwen3ForCausalLM / qwen3; transformers loads the export without warnings")


if __name__ == "__main__":
    import torch
    torch.set_num_threads(2)
    if sys.argv[1] == "make":
        make()
    elif sys.argv[1] == "logits":
        check_logits(sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "export":
        check_export(sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
