"""shardtrain's first step on packed chat data against transformers (issue 55, test_sft.sh part 1).

    python sft_check.py HF_DIR TOKENS.tok METRICS.jsonl GRADS_DIR [OUT_DIR]

The reference: LlamaForCausalLM from HF_DIR in float64, run on each training example of the
version 3 token file unpadded and alone (no packing, no document mask needed), with Hugging Face
labels: the example's ids where the role class is not context (0), -100 elsewhere; the loss is the
sum of every example's summed cross-entropy (transformers' own shift: labels[1:] predicted from the
prefix) divided by the global count of target tokens, and its gradient by autograd. The file is read
with scripts/shardtrain_tokens.py (numpy), not through shardtrain's packing. transformers computes
three things in float32 whatever the model's dtype: RMSNorm (LlamaRMSNorm.forward casts to float32),
RoPE's inverse frequencies and angles (LlamaRotaryEmbedding), and the eager attention's softmax; the
first two are replaced here by the same formulas in float64 and attention is SDPA's (float64 for
float64 inputs), so the reference is float64 throughout (with transformers' own code its float32
roundings part from a float64 model by ~3e-7 of a gradient's largest element).
Asserted: the metrics file's step-1 loss within 1e-6 relative (shardtrain runs fp32); each
parameter's gradient (GRADS_DIR/<name>.bin, float32, written by SHARDTRAIN_TEST_DUMP_GRADS) within
2e-5 of that parameter's largest reference element, every parameter present.
With OUT_DIR, the float64 reference is written there for the float64 comparison in mpi_tests
(Sft.DISABLED_Float64StepEqualsTransformers): config.json and tokens.tok (links), params/<name>.f64
(the weights) and grads/<name>.f64 (the gradient), little-endian float64, and loss.txt (the loss,
the target count).
"""
import json
import os
import sys

import numpy as np
import torch
import transformers.models.llama.modeling_llama as llama
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import shardtrain_tokens as stt  # noqa: E402

hf, tokpath, metrics, grads = sys.argv[1:5]
out = sys.argv[5] if len(sys.argv) > 5 else None
t = stt.read_token_file(tokpath)
n_train_ex = int(t["metadata"]["examples"]["train"])
starts = np.asarray(t["starts"], dtype=np.int64)
ids_all = np.asarray(t["train"], dtype=np.int64)
roles_all = np.asarray(t["roles"], dtype=np.int64)


def rms_norm_f64(self, h):  # LlamaRMSNorm.forward without its float32 cast
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def rope_f64(self, x, position_ids):  # LlamaRotaryEmbedding.forward (default RoPE) in float64
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq_f64
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


llama.LlamaRMSNorm.forward = rms_norm_f64
llama.LlamaRotaryEmbedding.forward = rope_f64
model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float64, attn_implementation="sdpa")
cfg = model.config
assert cfg.rope_parameters["rope_type"] == "default", cfg.rope_parameters
head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
model.model.rotary_emb.inv_freq_f64 = 1.0 / (
    cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
model.eval()  # no dropout (there is none); gradients still flow
total, count = torch.zeros((), dtype=torch.float64), 0
for e in range(n_train_ex):
    a, b = int(starts[e]), int(starts[e + 1]) if e + 1 < len(starts) else len(ids_all)
    ids = torch.tensor(ids_all[a:b]).unsqueeze(0)
    labels = ids.clone()
    labels[0, torch.tensor(roles_all[a:b] == 0)] = -100
    n = int((labels[0, 1:] != -100).sum())
    if n == 0:
        continue
    logits = model(input_ids=ids).logits
    ce = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
    total = total + ce
    count += n
loss = total / count
loss.backward()
if out:
    for sub in ("params", "grads"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    for name, p in model.named_parameters():
        p.detach().numpy().astype("<f8").tofile(os.path.join(out, "params", name + ".f64"))
        p.grad.detach().numpy().astype("<f8").tofile(os.path.join(out, "grads", name + ".f64"))
    with open(os.path.join(out, "loss.txt"), "w") as f:
        f.write(f"{loss.item():.17g} {count}\n")
    for src, dst in ((os.path.join(hf, "config.json"), "config.json"), (tokpath, "tokens.tok")):
        if not os.path.exists(os.path.join(out, dst)):
            os.symlink(os.path.abspath(src), os.path.join(out, dst))
ours = [r["loss"] for r in map(json.loads, open(metrics)) if "loss" in r]
rel = abs(ours[0] - loss.item()) / loss.item()
print(f"{'ok' if rel <= 1e-6 else 'FAIL'}: step-1 loss over {n_train_ex} conversations ({count} target tokens): "
      f"shardtrain {ours[0]:.9f}, transformers float64 {loss.item():.9f}, rel diff {rel:.1e} (tol 1e-6)")
ok = rel <= 1e-6
worst_name, worst = "", 0.0
checked = 0
for name, p in model.named_parameters():
    path = os.path.join(grads, name + ".bin")
    if not os.path.exists(path):
        print(f"FAIL: no gradient of {name} in {grads}")
        ok = False
        continue
    g = np.fromfile(path, dtype="<f4").astype(np.float64)
    ref = p.grad.detach().numpy().reshape(-1)
    if g.size != ref.size:
        print(f"FAIL: {name}: {g.size} elements, transformers {ref.size}")
        ok = False
        continue
    d = float(np.max(np.abs(g - ref)) / np.max(np.abs(ref)))
    checked += 1
    if d > worst:
        worst_name, worst = name, d
ok = ok and worst <= 2e-5 and checked > 0
print(f"{'ok' if worst <= 2e-5 else 'FAIL'}: step-1 gradients of {checked} parameters: max |shardtrain - transformers| "
      f"<= {worst:.1e} of the parameter's largest element (worst {worst_name}; tol 2e-5)")
sys.exit(0 if ok else 1)
