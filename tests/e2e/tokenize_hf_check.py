"""Checks scripts/tokenize_hf.py against independent references (tests/e2e/test_tokenize_hf.sh).

    python tokenize_hf_check.py make WORK     # tokenizers + corpus under WORK
    python tokenize_hf_check.py check WORK TOKFILE TOKENIZER_KIND INPUT...

"make" trains a small byte-level BPE (GPT-2-like: ByteLevel pre-tokenizer, no BOS, EOS
"<|endoftext|>") on generated text and saves WORK/gpt2/tokenizer.json; a Llama-3-like one (BOS
"<|begin_of_text|>", EOS "<|end_of_text|>", TemplateProcessing adding BOS, 70,000 added tokens, so
ids need u32) as WORK/llama3/tokenizer.json; and an AutoTokenizer directory WORK/auto
(PreTrainedTokenizerFast.save_pretrained of the Llama-3-like one). It writes the corpus:
WORK/corpus/*.txt (one document each, one empty) and WORK/corpus/docs.jsonl.

"check" reads TOKFILE with numpy alone (not scripts/shardtrain_tokens.py) and asserts: every header
field, ids == the reference's encode(doc, add_special_tokens=False) framed as [BOS] + ids + EOS
per document in input order, the split, the metadata, and the embedded files' bytes == the source
files. The reference is tokenizers.Tokenizer for the tokenizer.json kinds and transformers'
AutoTokenizer for the directory.
"""

import json
import os
import random
import sys
import zlib

import numpy as np

SEP = "<|endoftext|>"


def gen_text(rng, n_words):
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café", "über",
             "日本語", "テキスト", "Ελληνικά", "emoji🙂", "tab\there", "a", "of", "and", "shardtrain", "123", "4.5e-3"]
    out = []
    for _ in range(n_words):
        out.append(rng.choice(words))
        r = rng.random()
        out.append(" " if r < 0.7 else rng.choice(["  ", "\n", "\n\n", "\t", "   \n ", ". ", ", "]))
    return "".join(out)


def make(work):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers, AddedToken
    rng = random.Random(14)
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus, exist_ok=True)
    train_text = [gen_text(rng, 300) for _ in range(50)]

    def bpe(specials):
        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        tr = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        t.train_from_iterator(train_text, tr)
        return t

    g = bpe([SEP])
    g.post_processor = processors.ByteLevel(trim_offsets=False)
    os.makedirs(os.path.join(work, "gpt2"), exist_ok=True)
    g.save(os.path.join(work, "gpt2", "tokenizer.json"))

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    l3 = bpe([bos, eos])
    # Many added (special) tokens, as Llama 3's reserved ones: len(tokenizer) > 65536, so u32 ids.
    l3.add_special_tokens([AddedToken(f"<|reserved_special_token_{i}|>", special=True) for i in range(70000)])
    l3.add_tokens(["über café"])  # a normal added token (BPE can't learn it: a space), id > 65535, in the text
    l3.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                      special_tokens=[(bos, l3.token_to_id(bos))])
    os.makedirs(os.path.join(work, "llama3"), exist_ok=True)
    l3.save(os.path.join(work, "llama3", "tokenizer.json"))
    assert l3.get_vocab_size() > 65536, l3.get_vocab_size()

    os.makedirs(os.path.join(work, "noeos"), exist_ok=True)
    bpe([]).save(os.path.join(work, "noeos", "tokenizer.json"))  # no special tokens at all: no EOS

    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast(tokenizer_object=l3, bos_token=bos, eos_token=eos)
    fast.save_pretrained(os.path.join(work, "auto"))

    docs = [gen_text(rng, rng.randint(1, 200)) for _ in range(6)]
    docs[2] = "  \n\n   leading and trailing whitespace runs   \t\n"
    docs[1] = "über café, über  café\nüber café"
    docs[4] = ""  # an empty document: BOS? + EOS
    for i, d in enumerate(docs):
        with open(os.path.join(corpus, f"doc{i}.txt"), "w", encoding="utf-8", newline="") as f:
            f.write(d)
    recs = [{"text": gen_text(rng, rng.randint(0, 80)), "id": i} for i in range(40)]
    recs[7]["text"] = ""
    recs[9]["text"] = "non-ASCII only: ÄÖÜ ß 中文 🙂🙂 über café"
    with open(os.path.join(corpus, "docs.jsonl"), "w", encoding="utf-8") as f:
        for i, r in enumerate(recs):
            f.write(json.dumps(r, ensure_ascii=(i % 2 == 0)) + "\n")
            if i == 20:
                f.write("\n")  # a blank line: skipped
    print(f"made: tokenizers gpt2 ({g.get_vocab_size()}), llama3 ({l3.get_vocab_size()}), auto; "
          f"{len(docs)} text documents, {len(recs)} JSONL records")


def read_docs(inputs):
    docs = []
    for p in inputs:
        if p.endswith(".jsonl"):
            with open(p, encoding="utf-8") as f:
                docs += [json.loads(line)["text"] for line in f if line.strip()]
        else:
            with open(p, encoding="utf-8", newline="") as f:
                docs.append(f.read())
    return docs


def check(work, tokfile, kind, inputs):
    if kind == "auto":
        from transformers import AutoTokenizer
        ref = AutoTokenizer.from_pretrained(os.path.join(work, "auto"), local_files_only=True)
        encode = lambda d: ref.encode(d, add_special_tokens=False)  # noqa: E731
        vocab, bos, eos = len(ref), ref.bos_token_id, ref.eos_token_id
        src = {n: os.path.join(work, "auto", n) for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
               if os.path.exists(os.path.join(work, "auto", n))}
    else:
        from tokenizers import Tokenizer
        path = os.path.join(work, kind, "tokenizer.json")
        ref = Tokenizer.from_file(path)
        encode = lambda d: ref.encode(d, add_special_tokens=False).ids  # noqa: E731
        vocab = ref.get_vocab_size(with_added_tokens=True)
        bos = ref.token_to_id("<|begin_of_text|>")
        eos = ref.token_to_id(SEP) if kind == "gpt2" else ref.token_to_id("<|end_of_text|>")
        src = {"tokenizer.json": path}
    want = []
    docs = read_docs(inputs)
    for d in docs:
        want += ([bos] if bos is not None else []) + list(encode(d)) + [eos]
    want = np.array(want, dtype=np.int64)

    raw = open(tokfile, "rb").read()
    assert raw[:8] == b"STTOKv1\0", raw[:8]
    version, vocab_h, bos_h, eos_h, b, j = np.frombuffer(raw, "<u4", 6, 8).tolist()
    n_train, n_val = np.frombuffer(raw, "<u8", 2, 32).tolist()
    kind_h = raw[48:64]
    assert version == 2, version
    assert vocab_h == vocab, (vocab_h, vocab)
    assert bos_h == (0xFFFFFFFF if bos is None else bos), (bos_h, bos)
    assert eos_h == eos, (eos_h, eos)
    assert b == (2 if vocab <= 65536 else 4), (b, vocab)
    assert kind_h == b"hf-tokenizers".ljust(16, b"\0"), kind_h
    n = len(want)
    assert n_train + n_val == n, (n_train, n_val, n)
    assert n_val == int(n * 0.1), (n_val, n)
    ids = np.frombuffer(raw, "<u2" if b == 2 else "<u4", n, 64).astype(np.int64)
    if not np.array_equal(ids, want):
        k = int(np.argmax(ids != want)) if len(ids) == len(want) else -1
        raise AssertionError(f"ids differ from the reference (first at {k})")
    if b == 4:
        assert ids.max() > 65535, "the u32 case should use an id above 65535"
    end = 64 + b * n
    meta = json.loads(raw[end:end + j].decode("utf-8"))
    tk = meta["tokenizer"]
    assert meta["format"] == "shardtrain-tokens"
    assert (tk["kind"], tk["vocab_size"], tk["bos_id"], tk["eos_id"]) == ("hf-tokenizers", vocab, bos, eos), tk
    assert tk["add_bos"] == (bos is not None) and tk["add_eos"] is True, tk
    assert meta["documents"] == len(docs), (meta["documents"], len(docs))
    assert meta["inputs"] == len(inputs), meta["inputs"]
    area = end + j
    assert sorted(tk["files"]) == sorted(src), (sorted(tk["files"]), sorted(src))
    total = 0
    for name, fm in tk["files"].items():
        data = raw[area + fm["offset"]: area + fm["offset"] + fm["bytes"]]
        assert data == open(src[name], "rb").read(), f"embedded {name} differs from {src[name]}"
        assert zlib.crc32(data) == fm["crc32"], name
        total += fm["bytes"]
    assert len(raw) == area + total, (len(raw), area + total)
    # The shared module reads the same.
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import shardtrain_tokens as st
    t = st.read_token_file(tokfile)
    assert np.array_equal(np.concatenate([t["train"], t["val"]]).astype(np.int64), want)
    assert t["files"]["tokenizer.json"] == open(src["tokenizer.json"], "rb").read()
    print(f"ok: {os.path.basename(tokfile)}: {n} tokens ({n_train} train, {n_val} val), u{8 * b}, {len(docs)} documents, "
          f"vocab {vocab}, bos {bos_h:#x}, eos {eos}, files {sorted(tk['files'])} == reference")


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        check(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
