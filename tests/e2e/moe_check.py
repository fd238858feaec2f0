"""The reference for tests/mpi/test_moe.cpp Moe.DISABLED_LogitsAndLossEqualTransformers (run by
tests/e2e/test_moe.sh): tiny MixtralForCausalLM and Qwen3MoeForCausalLM models (8 experts, top 2)
made by transformers with random weights, and what transformers computes with them in fp32.

Usage:
  moe_check.py make OUT
  moe_check.py logits DIR LOGITS IDS   transformers' fp32 logits of [BOS] + IDS (comma-separated) for
                                       the model in DIR against shardtrain's --dump-logits file
                                       LOGITS: within 1e-5
  moe_check.py export SRC OUT          OUT (shardtrain's export of SRC's import, or of a model
                                       trained from it: TRAINED=1) holds the hub's per-expert names,
                                       every tensor of SRC and nothing else (bitwise unless trained),
                                       and transformers loads it without warnings
make writes, for NAME in mixtral, qwen3_moe, OUT/NAME/:
  config.json                     save_pretrained's (the architecture's own keys)
  params/<name>.f32               every parameter under transformers' in-memory name (fused experts:
                                  mlp.experts.gate_up_proj [E, 2I, C], mlp.experts.down_proj [E, C, I])
  tokens.i32                      the batch [B, T] (int32)
  logits.f32                      transformers' fp32 logits of the batch [B*T, V]
  loss.txt                        "ce aux loss" of model(tokens, labels=tokens, output_router_logits=True):
                                  the mean next-token cross-entropy, the load-balancing loss of the
                                  whole forward call (load_balancing_loss_func pools every MoE layer's
                                  rows of the micro-batch) and ce + router_aux_loss_coef * aux
  tokens1.i32, loss1.txt          the same for the batch's first sequence alone (B = 1): where the aux
                                  loss per sequence and per micro-batch coincide
  z.txt                           "z z1": the router z-loss (ST-MoE) of the batch and of its first
                                  sequence, from the forward's router_logits in float64: the mean of
                                  logsumexp(logits)^2 over every MoE layer's rows (pooled as
                                  load_balancing_loss_func pools them; transformers has no z-loss)
The router weights are drawn wider than the init (std 0.5) so that every token's top-2 is decided
by a margin, and the q/k norm weights away from ones.
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

B, T, V = 3, 24, 300


def models():
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-6, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                  output_router_logits=True, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257)
    torch.manual_seed(0)
    yield "mixtral", MixtralForCausalLM(MixtralConfig(intermediate_size=40, num_local_experts=8, **common))
    torch.manual_seed(1)
    yield "qwen3_moe", Qwen3MoeForCausalLM(Qwen3MoeConfig(
        intermediate_size=48, moe_intermediate_size=20, num_experts=8, head_dim=16, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1], **common))


def run(model, tokens):
    with torch.no_grad():
        out = model(torch.tensor(tokens), labels=torch.tensor(tokens), output_router_logits=True)
    ce = out.loss.item() - model.config.router_aux_loss_coef * out.aux_loss.item()
    return out, ce


def z_loss(out):
    z = torch.cat([g.double() for g in out.router_logits if g is not None], dim=0)
    return (torch.logsumexp(z, dim=-1) ** 2).mean().item()


def main(out_dir):
    rng = np.random.default_rng(5)
    for name, model in models():
        d = os.path.join(out_dir, name)
        os.makedirs(os.path.join(d, "params"), exist_ok=True)
        model = model.float().eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.5)
                elif n.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(1 + 0.3 * torch.randn_like(p))
        model.save_pretrained(d, safe_serialization=True)
        for n, p in model.named_parameters():
            p.detach().numpy().astype("<f4").tofile(os.path.join(d, "params", n + ".f32"))
        tokens = rng.integers(0, V, size=(B, T)).tolist()
        np.asarray(tokens, dtype="<i4").tofile(os.path.join(d, "tokens.i32"))
        out, ce = run(model, tokens)
        out.logits.reshape(B * T, V).numpy().astype("<f4").tofile(os.path.join(d, "logits.f32"))
        with open(os.path.join(d, "loss.txt"), "w") as f:
            f.write(f"{ce:.17g} {out.aux_loss.item():.17g} {out.loss.item():.17g}\n")
        np.asarray(tokens[:1], dtype="<i4").tofile(os.path.join(d, "tokens1.i32"))
        out1, ce1 = run(model, tokens[:1])
        with open(os.path.join(d, "loss1.txt"), "w") as f:
            f.write(f"{ce1:.17g} {out1.aux_loss.item():.17g} {out1.loss.item():.17g}\n")
        with open(os.path.join(d, "z.txt"), "w") as f:
            f.write(f"{z_loss(out):.17g} {z_loss(out1):.17g}\n")
        cfg = json.load(open(os.path.join(d, "config.json")))
        print(f"ok: {name}: {cfg['architectures'][0]}, {sum(p.numel() for p in model.parameters())} parameters, "
              f"loss {out.loss.item():.6f} (ce {ce:.6f} + {model.config.router_aux_loss_coef} x aux "
              f"{out.aux_loss.item():.6f})")


def load(path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_capture import load_checked
    return load_checked(path)


def check_logits(d, logits_file, ids_text):
    model = load(d)
    ids = [model.config.bos_token_id] + [int(x) for x in ids_text.split(",")]
    ours = np.fromfile(logits_file, dtype="<f4").reshape(len(ids), -1).astype(np.float64)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].double().numpy()
    err = float(np.abs(ours - theirs).max())
    assert err <= 1e-5, f"{d}: max |logit difference| {err:.3e} > 1e-5"
    print(f"ok: {os.path.basename(d.rstrip('/'))}: transformers' fp32 logits of {len(ids)} ids ({type(model).__name__}) "
          f"equal shardtrain's, max abs difference {err:.2e}")


def check_export(src, out, trained):
    from safetensors.torch import load_file
    import glob
    def tensors(d):
        t = {}
        for f in sorted(glob.glob(f"{d}/*.safetensors")):
            t.update(load_file(f))
        return t
    a, b = tensors(src), tensors(out)
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:6]
    experts = [k for k in b if ".experts." in k]
    assert experts and all(k.endswith(".weight") for k in experts), experts[:3]  # the hub's per-expert names
    if not trained:
        for k in a:
            assert torch.equal(a[k].float(), b[k]), f"{k}: not bitwise equal"
    else:
        moved = sum(not torch.equal(a[k].float(), b[k]) for k in a)
        assert moved == len(a), f"only {moved} of {len(a)} tensors changed in training"
    load(out)
    print(f"ok: {os.path.basename(out.rstrip('/'))}: {len(b)} tensors under the hub's names ({len(experts)} per-expert), "
          f"{'every one trained' if trained else 'bitwise those of ' + os.path.basename(src.rstrip('/'))}; "
          f"transformers loads it without warnings")


if __name__ == "__main__":
    torch.set_num_threads(2)
    if sys.argv[1] == "make":
        main(sys.argv[2])
    elif sys.argv[1] == "logits":
        check_logits(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "export":
        check_export(sys.argv[2], sys.argv[3], os.environ.get("TRAINED") == "1")
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
