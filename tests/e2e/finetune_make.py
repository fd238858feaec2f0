"""Makes a small Hugging Face Llama for tests/e2e/test_finetune.sh, nothing downloaded: a SentencePiece
tokenizer trained here (Llama's settings: BPE, byte fallback, dummy prefix, identity normalization),
random weights from transformers, and the files a Llama repository holds (config.json,
model.safetensors, tokenizer.model, tokenizer.json, tokenizer_config.json). Also writes the
fine-tuning corpus (corpus/*.txt, one document each). Usage: finetune_make.py WORK"""
import os, random, shutil, sys

import sentencepiece as spm
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

work = sys.argv[1]
random.seed(0)
words = ["the", "king", "queen", "of", "and", "to", "thou", "art", "love", "night", "day", "crown", "sword",
         "é", "naïve", "日本語", "🙂", "sea", "ship", "storm"]
def sentence():
    return " ".join(random.choice(words) for _ in range(random.randint(3, 12)))
os.makedirs(f"{work}/corpus", exist_ok=True)
docs = ["\n".join(sentence() for _ in range(random.randint(2, 8))) for _ in range(300)]
for i, d in enumerate(docs):
    open(f"{work}/corpus/doc{i:03d}.txt", "w", encoding="utf-8").write(d + "\n")
open(f"{work}/sp_train.txt", "w", encoding="utf-8").write("\n".join(docs))
spm.SentencePieceTrainer.train(input=f"{work}/sp_train.txt", model_prefix=f"{work}/sp", vocab_size=320,
                               model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                               remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
                               allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                               character_coverage=1.0, minloglevel=2)
hf = f"{work}/hf"
os.makedirs(hf, exist_ok=True)
shutil.copy(f"{work}/sp.model", f"{hf}/tokenizer.model")
open(f"{hf}/tokenizer_config.json", "w").write(
    '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",'
    ' "add_bos_token": true, "add_eos_token": false, "legacy": false, "clean_up_tokenization_spaces": false}')
tok = AutoTokenizer.from_pretrained(hf)  # converts tokenizer.model; saves tokenizer.json beside it
tok.save_pretrained(hf)
assert os.path.exists(f"{hf}/tokenizer.model") and os.path.exists(f"{hf}/tokenizer.json")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
LlamaForCausalLM(cfg).save_pretrained(hf, safe_serialization=True)
print("made", hf, sorted(os.listdir(hf)))
