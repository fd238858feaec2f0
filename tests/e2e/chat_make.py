"""Makes the chat-data fixtures of issue 55 offline: one byte-level BPE tokenizer (trained here with
the tokenizers library, with the special tokens of two public chat-template styles) saved as four
model directories that differ only in their chat template, and JSONL inputs.

    python chat_make.py OUTDIR

OUTDIR/chatml       ChatML (<|im_start|>role ... <|im_end|>), as Qwen2.5's template is published:
                    no {% generation %} markers; EOS <|im_end|>, no BOS
OUTDIR/llama3       Llama-3.1 style headers, <|eot_id|> after every turn, a "Today Date:" line from
                    date_string or strftime_now, as published: no markers; BOS <|begin_of_text|>,
                    EOS <|eot_id|>
OUTDIR/chatml-gen   the ChatML template with {% generation %} around each assistant answer and its
OUTDIR/llama3-gen   end of turn (as TRL's training templates put them), and the Llama-3 one likewise
OUTDIR/plain        the tokenizer without any chat template
OUTDIR/chat.jsonl   50 conversations of very different lengths: with and without a system message,
                    1-6 turns, non-ASCII text, an answer that starts with spaces, an empty-ish answer
OUTDIR/pc.jsonl     prompt/completion records: strings, and message lists
The templates are written here in the published styles (not copied); the test's references come
from transformers, not from these files.
"""

import json
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<pad>"]

CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- if tools %}{{- '<|im_start|>tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}@GEN@{{- message['content'] + '<|im_end|>' }}@END@{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3 = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}"
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "@GEN@{{- message['content'] | trim + '<|eot_id|>' }}@END@"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or "
         "had by hot word but what some we can out other were all there when up use your how said an each "
         "she which do their time if will way about many then them write would like so these her long make "
         "thing see him two has look more day could go come did number sound no most people my over know "
         "water than call first who may down side been now find any new work part take get place made live "
         "where after back little only round man year came show every good me give our under name very "
         "through just form sentence great think say help low line differ turn cause much mean before move "
         "right boy old too same tell does set three want air well also play small end put home read hand "
         "port large spell add even land here must big high such follow act why ask men change went light "
         "kind off need house picture try us again animal point mother world near build self earth father").split()
EXTRA = ["naïve café", "日本語のテキスト", "emoji 🙂🚀", "tabs\tand\tmore", "x = 3 * (y + 2)", "«quotes»", "Ωμέγα"]


def sentence(rng, lo, hi):
    n = rng.randint(lo, hi)
    w = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.2:
        w.insert(rng.randrange(len(w) + 1), rng.choice(EXTRA))
    s = " ".join(w)
    return s[0].upper() + s[1:] + rng.choice([".", "?", "!", ".\n\nAnd more."])


def conversations(rng, n):
    out = []
    for k in range(n):
        msgs = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": sentence(rng, 3, 12)})
        turns = rng.choice([1, 1, 2, 3, 6]) if k % 10 else 1
        for t in range(turns):
            msgs.append({"role": "user", "content": sentence(rng, 2, 30 if k % 7 else 150)})
            ans = sentence(rng, 1, 60 if k % 5 else 250)
            if k == 3 and t == 0:
                ans = "   " + ans  # an answer that starts with spaces (the Llama template trims it)
            if k == 4:
                ans = "Ok."
            msgs.append({"role": "assistant", "content": ans})
        out.append({"messages": msgs})
    return out


def main(outdir):
    rng = random.Random(55)
    os.makedirs(outdir, exist_ok=True)
    convs = conversations(rng, 50)
    corpus = [m["content"] for c in convs for m in c["messages"]] + EXTRA + WORDS
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus * 3, trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    styles = {
        "chatml": (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<pad>"}),
        "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<pad>"}),
    }
    for name, (template, special) in styles.items():
        for suffix, gen, end in (("", "", ""), ("-gen", "{%- generation %}", "{%- endgeneration %}")):
            tok = PreTrainedTokenizerFast(tokenizer_object=tk, **special)
            tok.chat_template = template.replace("@GEN@", gen).replace("@END@", end)
            tok.save_pretrained(os.path.join(outdir, name + suffix))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(os.path.join(outdir, "plain"))
    with open(os.path.join(outdir, "chat.jsonl"), "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    with open(os.path.join(outdir, "pc.jsonl"), "w", encoding="utf-8") as f:
        for k in range(12):
            if k % 2:
                rec = {"prompt": [{"role": "user", "content": sentence(rng, 2, 20)}],
                       "completion": [{"role": "assistant", "content": sentence(rng, 1, 30)}]}
            else:
                rec = {"prompt": sentence(rng, 2, 20) + " ", "completion": sentence(rng, 1, 30)}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"chat_make: {len(convs)} conversations, 12 prompt/completion records, vocab {tk.get_vocab_size()}")


if __name__ == "__main__":
    main(sys.argv[1])
