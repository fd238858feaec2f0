"""Checks a version-2 token file (docs/data-format.md) written by --mode prepare against
independent references.

usage: token_file_check.py TOKFILE DOCS_JSON (MODEL|byte-level) VAL_FRACTION [HF_DIR]

Parses the header, the metadata JSON and the tokenizer file blobs (sizes, CRC32, and
tokenizer.model byte for byte equal to MODEL); rebuilds the expected token stream from the
documents of DOCS_JSON framed BOS + ids + EOS, the ids from Python sentencepiece (or the UTF-8
bytes for byte-level), and checks it equals the file's tokens and the train/validation split. With
HF_DIR (a directory holding only tokenizer.model): transformers' AutoTokenizer must give the same
ids for every document, and LlamaTokenizer for every document that does not start with a space
(its Metaspace pre-tokenizer, prepend_scheme "first", adds no dummy prefix before a leading space,
where SentencePiece does: docs/data-format.md, "Tokenizers")."""
import json, struct, sys, zlib

import numpy as np

path, docs_path, model, vf = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
hf_dir = sys.argv[5] if len(sys.argv) > 5 else None
raw = open(path, "rb").read()
assert raw[:8] == b"STTOKv1\0", raw[:8]
version, vocab, bos, eos, tb, J = struct.unpack_from("<6I", raw, 8)
n_train, n_val = struct.unpack_from("<2Q", raw, 32)
kind = raw[48:64].rstrip(b"\0").decode()
assert version == 2 and tb in (2, 4), (version, tb)
n = n_train + n_val
tok = np.frombuffer(raw, dtype="<u2" if tb == 2 else "<u4", count=n, offset=64).astype(np.int64)
meta = json.loads(raw[64 + tb * n: 64 + tb * n + J].decode("utf-8"))
area = 64 + tb * n + J
t = meta["tokenizer"]
assert meta["format"] == "shardtrain-tokens" and t["kind"] == kind and t["vocab_size"] == vocab
assert t["bos_id"] == (None if bos == 0xFFFFFFFF else bos) and t["eos_id"] == eos
blobs = {}
for name, f in t["files"].items():
    b = raw[area + f["offset"]: area + f["offset"] + f["bytes"]]
    assert len(b) == f["bytes"] and zlib.crc32(b) == f["crc32"], name
    blobs[name] = b
assert len(raw) == area + sum(f["bytes"] for f in t["files"].values()), "file size"
docs = json.load(open(docs_path, encoding="utf-8"))
assert meta["documents"] == len(docs), (meta["documents"], len(docs))

if model == "byte-level":
    assert kind == "byte-level" and vocab == 258 and blobs == {}
    enc = lambda d: list(d.encode("utf-8"))
else:
    import sentencepiece as spm
    assert blobs["tokenizer.model"] == open(model, "rb").read(), "embedded tokenizer.model differs from the file"
    sp = spm.SentencePieceProcessor(model_file=model)
    assert kind == "sentencepiece" and vocab == sp.get_piece_size() and bos == sp.bos_id() and eos == sp.eos_id()
    enc = lambda d: sp.encode(d)
expected = []
per_doc = []
for d in docs:
    ids = enc(d)
    per_doc.append(ids)
    expected += ([bos] if bos != 0xFFFFFFFF else []) + ids + [eos]
expected = np.array(expected, dtype=np.int64)
assert len(expected) == n, (len(expected), n)
bad = np.nonzero(expected != tok)[0]
assert len(bad) == 0, f"{len(bad)} tokens differ, first at {bad[0]}: file {tok[bad[0]:bad[0]+8]} vs {expected[bad[0]:bad[0]+8]}"
assert n_val == int(n * vf) and n_train == n - n_val, (n_train, n_val)
print(f"ok: {path}: {n} tokens of {len(docs)} documents ({sum(1 for d in docs if d == '')} empty) equal the reference "
      f"({'Python sentencepiece' if model != 'byte-level' else 'UTF-8 bytes'}), split {n_train}/{n_val}, "
      f"{len(blobs)} embedded file(s) verified")

if hf_dir:
    from transformers import AutoTokenizer, LlamaTokenizer
    auto = AutoTokenizer.from_pretrained(hf_dir)
    llama = LlamaTokenizer.from_pretrained(hf_dir)
    a_bad = [d for d, ids in zip(docs, per_doc) if auto(d, add_special_tokens=False)["input_ids"] != ids]
    assert not a_bad, f"AutoTokenizer ({type(auto).__name__}) differs on {len(a_bad)} documents, first {a_bad[0][:60]!r}"
    l_bad = [d for d, ids in zip(docs, per_doc) if llama(d, add_special_tokens=False)["input_ids"] != ids]
    unexpected = [d for d in l_bad if not d.startswith(" ")]
    assert not unexpected, f"LlamaTokenizer differs on {len(unexpected)} documents, first {unexpected[0][:60]!r}"
    print(f"ok: transformers AutoTokenizer ({type(auto).__name__}) gives the ids of all {len(docs)} documents; "
          f"LlamaTokenizer those of {len(docs) - len(l_bad)}, and differs only on the {len(l_bad)} starting with a space "
          f"(no dummy prefix before a leading space)")
