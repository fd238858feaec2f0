"""Makes Hugging Face model directories for tests/e2e/test_hf_import.sh with transformers itself,
and crafted (broken) variants. Usage: hf_import_make.py WORK"""
import json, os, shutil, struct, sys

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

work = sys.argv[1]
common = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257)

def make(name, model):
    model.save_pretrained(f"{work}/{name}", safe_serialization=True)

torch.manual_seed(0)
make("untied", LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common)))
torch.manual_seed(1)
make("tied", LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common)))
torch.manual_seed(2)
make("bf16", LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common)).to(torch.bfloat16))
torch.manual_seed(3)
make("mistral", MistralForCausalLM(MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)))
torch.manual_seed(4)
m = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
make("sharded_src", m)
m.save_pretrained(f"{work}/sharded", safe_serialization=True, max_shard_size="40KB")

torch.manual_seed(5)
make("rope", LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, rope_theta=500000.0, **common)))

def variant(src, dst):
    shutil.copytree(f"{work}/{src}", f"{work}/{dst}")
    return f"{work}/{dst}"

# Names as left behind by torch.compile, DDP and FSDP wrappers, plus a rotary buffer.
d = variant("untied", "prefixed")
sd = load_file(f"{d}/model.safetensors")
wrapped = {}
for i, (k, v) in enumerate(sorted(sd.items())):
    p = ["_orig_mod.", "module.", "_fsdp_wrapped_module."][i % 3]
    k2 = p + k if i % 2 == 0 else k.replace("model.layers.", "model._fsdp_wrapped_module.layers.")
    wrapped[k2] = v
wrapped["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.arange(12, dtype=torch.float32)
save_file(wrapped, f"{d}/model.safetensors", metadata={"format": "pt"})

# Refusals.
d = variant("untied", "missing_tensor")
sd = load_file(f"{d}/model.safetensors"); del sd["model.layers.1.mlp.down_proj.weight"]
save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
d = variant("untied", "wrong_shape")
cfg = json.load(open(f"{d}/config.json")); cfg["intermediate_size"] = 100
json.dump(cfg, open(f"{d}/config.json", "w"))
d = variant("sharded", "missing_shard")
idx = json.load(open(f"{d}/model.safetensors.index.json"))
victim = sorted(set(idx["weight_map"].values()))[-1]
os.remove(f"{d}/{victim}")
open(f"{work}/missing_shard.name", "w").write(victim)

def rewrite_header(d, edit):
    path = f"{d}/model.safetensors"
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    new = edit(h)
    hb = new if isinstance(new, bytes) else json.dumps(new).encode()
    hb += b" " * (-len(hb) % 8)
    open(path, "wb").write(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])

def overlap(h):
    k = "model.layers.0.self_attn.k_proj.weight"
    b, e = h[k]["data_offsets"]
    h[k]["data_offsets"] = [b - 8, e - 8]
    return h
rewrite_header(variant("untied", "overlap"), overlap)
def out_of_range(h):
    k = "model.norm.weight"
    b, e = h[k]["data_offsets"]
    h[k]["data_offsets"] = [b + 10**9, e + 10**9]
    return h
rewrite_header(variant("untied", "out_of_range"), out_of_range)
rewrite_header(variant("untied", "bad_json"), lambda h: b'{"model.norm.weight": {"dtype": "F32", "shape": [48], ')

def edit_config(src, dst, **kv):
    d = variant(src, dst)
    cfg = json.load(open(f"{d}/config.json")); cfg.update(kv)
    json.dump(cfg, open(f"{d}/config.json", "w"))
edit_config("untied", "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
edit_config("untied", "qwen2", architectures=["Qwen2ForCausalLM"], model_type="qwen2")
edit_config("mistral", "sliding", sliding_window=16)
edit_config("rope", "llama3_rope", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
edit_config("rope", "yarn_rope", rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
            "original_max_position_embeddings": 32})
edit_config("rope", "linear_rope_v4", rope_scaling={"type": "linear", "factor": 2.0})
d = variant("tied", "tied_diff_head")
sd = load_file(f"{d}/model.safetensors")
sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone() + 1.0
save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
# Header lengths: above the safetensors format's 100,000,000-byte limit but inside the file (sparse
# files, nothing is written past the first bytes), and one byte longer than the rest of the file.
def set_header_length(src, dst, n, size=None):
    path = f"{variant(src, dst)}/model.safetensors"
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", n))
        if size is not None:
            f.truncate(size)
set_header_length("untied", "header_200mib", 200 << 20, 210 << 20)
set_header_length("untied", "header_limit_plus_1", 100_000_001, 100_000_001 + 8)
set_header_length("untied", "header_past_eof", os.path.getsize(f"{work}/untied/model.safetensors") - 8 + 1)
# eos_token_id as a list (Llama 3.x style). A vocab-258 model whose greedy next byte X after BOS +
# EOS_PROMPT (transformers' own argmax, clear of the runner-up) is a printable byte; saved with
# eos_token_id 257 and with [257, X]: generation must stop at once for the second only.
EOS_PROMPT = "ROMEO:"
byte_cfg = dict(common, vocab_size=258)
for seed in range(100, 200):
    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **byte_cfg)).eval()
    with torch.no_grad():
        last = m(torch.tensor([[256] + list(EOS_PROMPT.encode())])).logits[0, -1]
    top = torch.topk(last, 2)
    x = int(top.indices[0])
    if 33 <= x <= 126 and float(top.values[0] - top.values[1]) > 1e-3:
        break
else:
    sys.exit("no seed in 100..199 gives a printable greedy byte")
make("eos_one", m)
make("eos_list_src", m)
edit_config("eos_list_src", "eos_list", eos_token_id=[257, x])
edit_config("eos_list_src", "eos_nonint", eos_token_id=[257, "x"])
edit_config("eos_list_src", "eos_oov", eos_token_id=[257, 258])
open(f"{work}/eos_greedy.txt", "w").write(f"{x}\n")
print(f"eos models: seed {seed}, greedy byte after BOS + {EOS_PROMPT!r}: {x} ({chr(x)!r})")
print("made", sorted(os.listdir(work)))
