"""Checks a version 3 token file written by scripts/tokenize_hf.py from chat or prompt/completion
JSONL against transformers (issue 55, items 1 and 2).

    python chat_data_check.py TOKFILE MODEL_DIR JSONL [--val-fraction F] [--date-string D]

The file is parsed here with numpy and the format's text alone (docs/data-format.md), not with
scripts/shardtrain_tokens.py. Asserted, example by example (one per non-blank JSONL line):
  * the ids are transformers' apply_chat_template(messages, tokenize=True) exactly (prompt/completion
    strings: tokenizer(prompt) + tokenizer(completion, add_special_tokens=False) + EOS, as TRL);
  * the assistant tokens (role classes 1 and 2) are transformers' assistant_masks where the template
    has {% generation %} markers; without markers, the reference computed here from token-level
    prefixes: the ids of render(messages[:i], add_generation_prompt=True) and of
    render(messages[:i+1]) are prefixes of the conversation's ids, and the tokens between them, up
    to and including the first special token, are the answer and its end of turn;
  * class 2 is exactly the special token that ends each assistant span;
  * examples.end_of_turn_ids is the distinct ids of the reference's end-of-turn tokens, ascending;
  * starts, the split (the last floor(count * F) examples are the validation split), the CRC32s,
    the file size, and the template recorded (SHA-256, markers, date).
Prints one line per file: examples, tokens, assistant tokens.
"""

import argparse
import hashlib
import json
import os
import struct
import sys
import zlib

import numpy as np


def parse(path):
    raw = open(path, "rb").read()
    magic, version, vocab, bos, eos, b, J, n_train, n_val = struct.unpack_from("<8sIIIIIIQQ", raw, 0)
    assert magic == b"STTOKv1\0" and version == 3, (magic, version)
    n = n_train + n_val
    tok = np.frombuffer(raw, dtype="<u2" if b == 2 else "<u4", count=n, offset=64)
    meta = json.loads(raw[64 + b * n: 64 + b * n + J])
    area = 64 + b * n + J
    ex = meta["examples"]
    entries = [(f["offset"], f["bytes"], f["crc32"]) for f in meta["tokenizer"]["files"].values()]
    entries += [(ex[k]["offset"], ex[k]["bytes"], ex[k]["crc32"]) for k in ("starts", "roles")]
    at = 0
    for off, nb, crc in sorted(entries):
        assert off == at, (off, at)
        assert zlib.crc32(raw[area + off: area + off + nb]) == crc
        at += nb
    assert len(raw) == area + at, (len(raw), area + at)
    starts = np.frombuffer(raw, dtype="<u8", count=ex["count"], offset=area + ex["starts"]["offset"]).astype(np.int64)
    roles = np.frombuffer(raw, dtype="u1", count=n, offset=area + ex["roles"]["offset"])
    files = {k: raw[area + f["offset"]: area + f["offset"] + f["bytes"]] for k, f in meta["tokenizer"]["files"].items()}
    return dict(tok=tok, n_train=n_train, n_val=n_val, meta=meta, ex=ex, starts=starts, roles=roles, files=files,
                bos=None if bos == 0xFFFFFFFF else bos, eos=None if eos == 0xFFFFFFFF else eos)


def reference(tok, rec, markers, special, kw):
    """(ids, assistant mask, end-of-turn positions) of one record, from transformers."""
    if "prompt" in rec and isinstance(rec["prompt"], str):
        p = tok(rec["prompt"])["input_ids"]  # TRL's prompt ids: the tokenizer's own special tokens
        c = tok(rec["completion"], add_special_tokens=False)["input_ids"]
        ids = p + c + [tok.eos_token_id]
        return ids, [0] * len(p) + [1] * (len(c) + 1), {len(ids) - 1}
    if "prompt" in rec:
        msgs, first = rec["prompt"] + rec["completion"], len(rec["prompt"])
    else:
        msgs, first = rec["messages"], 0
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=markers and first == 0,
                                  **kw)
    ids = list(out["input_ids"])
    if markers and first == 0:
        mask = list(out["assistant_masks"])
    else:
        mask = [0] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant" or i < first:
                continue
            a = tok.apply_chat_template(msgs[:i], tokenize=True, add_generation_prompt=True, return_dict=True, **kw)["input_ids"]
            z = tok.apply_chat_template(msgs[: i + 1], tokenize=True, return_dict=True, **kw)["input_ids"]
            assert ids[: len(a)] == list(a) and ids[: len(z)] == list(z), f"token prefixes differ at message {i}"
            end = next(t for t in range(len(a), len(z)) if ids[t] in special)
            for t in range(len(a), end + 1):
                mask[t] = 1
    eot = set()
    for t in range(len(ids)):  # the last token of each assistant run, when it is a special token
        if mask[t] and (t + 1 == len(ids) or not mask[t + 1]) and ids[t] in special:
            eot.add(t)
    return ids, mask, eot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokfile")
    ap.add_argument("model_dir")
    ap.add_argument("jsonl")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--date-string")
    a = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model_dir, local_files_only=True)
    f = parse(a.tokfile)
    recs = [json.loads(line) for line in open(a.jsonl, encoding="utf-8") if line.strip()]
    template = tok.chat_template or ""
    markers = "{%- generation %}" in template or "{% generation %}" in template
    kw = {"date_string": a.date_string} if a.date_string else {}
    special = {int(i) for i, t in tok.added_tokens_decoder.items() if t.special}
    ex, starts, roles, toks = f["ex"], f["starts"], f["roles"], f["tok"]
    assert ex["count"] == len(recs), (ex["count"], len(recs))
    n = len(toks)
    bounds = list(starts) + [n]
    n_asst = 0
    eot_ids = set()  # the ids of the reference's end-of-turn tokens
    for e, rec in enumerate(recs):
        ids, mask, eot = reference(tok, rec, markers, special, kw)
        eot_ids.update(ids[t] for t in eot)
        got = toks[bounds[e]: bounds[e + 1]].tolist()
        assert got == ids, f"example {e}: ids differ from transformers' (first at {next(i for i in range(min(len(got), len(ids))) if got[i] != ids[i]) if got[:len(ids)] != ids[:len(got)] else min(len(got), len(ids))})"
        r = roles[bounds[e]: bounds[e + 1]].tolist()
        gm = [int(x != 0) for x in r]
        if gm != mask:
            t = next(i for i in range(len(mask)) if gm[i] != mask[i])
            raise AssertionError(f"example {e}: assistant mask differs at token {t} ({tok.decode(ids[max(0, t - 3): t + 3])!r}): "
                                 f"file {gm[max(0, t - 3): t + 3]}, reference {mask[max(0, t - 3): t + 3]}")
        got_eot = {t for t, x in enumerate(r) if x == 2}
        assert got_eot == eot, f"example {e}: end-of-turn tokens at {sorted(got_eot)}, reference {sorted(eot)}"
        n_asst += sum(gm)
    assert ex["end_of_turn_ids"] == sorted(eot_ids), (ex["end_of_turn_ids"], sorted(eot_ids))
    e_val = int(np.floor(len(recs) * a.val_fraction))
    assert ex["val"] == e_val and ex["train"] == len(recs) - e_val, ex
    assert f["n_train"] == (bounds[len(recs) - e_val] if e_val else n), (f["n_train"], bounds[len(recs) - e_val])
    if template and "messages" in recs[0]:
        assert ex["template"]["sha256"] == hashlib.sha256(template.encode()).hexdigest()
        assert ex["template"]["generation_markers"] == markers
        assert ex["template"]["date_string"] == a.date_string
        assert f["files"]["chat_template.jinja"].decode() == template
    print(f"ok: {os.path.basename(a.tokfile)}: {len(recs)} examples, {n} tokens, {n_asst} assistant tokens equal "
          f"transformers' ({'generation markers' if markers else 'token-prefix reference'}), split {ex['train']}/{ex['val']}, "
          f"end_of_turn_ids {ex['end_of_turn_ids']}")


if __name__ == "__main__":
    sys.exit(main())
