"""Document masking against transformers (issue 41): shardtrain's mean loss on a packed batch equals
transformers' on the same tokens.

Usage: document_mask_check.py make T OUT_TOK OUT_RAW
  writes OUT_TOK, a shardtrain token file (version 1, byte-level ids, BOS 256, EOS 257) whose train
  and validation splits hold exactly T + 1 tokens each (so every sequence shardtrain reads is that
  split from offset 0: the tokens are known here), packed documents of varied lengths, the train
  split starting inside a document, documents shorter than a tile, longer than one, straddling the
  64-token tile seams; and OUT_RAW, the same train tokens as a nanoGPT raw u16 file (no EOS id).
Usage: document_mask_check.py check T OUT_TOK HF_DIR NAME=METRICS...
  for each NAME (doc*, causal*) the loss of step 1 and the final val_loss of METRICS (shardtrain
  --metrics, JSON lines) against transformers' fp32 CPU loss (mean cross-entropy over the T
  targets) of the HF_DIR export: for doc*, given position_ids that restart at 0 at each document's
  first token (a document ends AT its EOS) and the block-diagonal causal 4-D mask [1, 1, T, T]
  (0 where query t may see key s: s <= t in the same document; the float32 minimum elsewhere);
  for causal*, without either. Each within 1e-5 relative (NAME with "bf16": 2e-3, and nearer its
  mask's reference than the other's); the two references differ by > 1e-3.
"""
import json
import os
import struct
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BOS, EOS, V = 256, 257, 258
TOL = 1e-5
TOL_BF16 = 2e-3  # --precision bf16 runs (bf16 weights and activations, fp32 arithmetic)


def split_tokens(T, lengths, start_inside, seed):
    """T + 1 tokens: documents of `lengths` (BOS + bytes + EOS), the first cut to start inside."""
    import random
    rnd = random.Random(seed)
    toks = []
    for i, n in enumerate(lengths):
        doc = [BOS] + [rnd.randrange(32, 127) for _ in range(max(0, n - 2))] + [EOS]
        if i == 0 and start_inside:
            doc = doc[len(doc) // 2:]
        toks += doc
    assert len(toks) >= T + 1, (len(toks), T)
    return toks[:T + 1]


def make(T, out_tok, out_raw):
    train = split_tokens(T, [40, 9, 3, 70, 25, 2, 60, 30], True, 1)
    val = split_tokens(T, [66, 5, 5, 5, 90, 40], False, 2)
    head = b"STTOKv1\0" + struct.pack("<6I", 1, V, BOS, EOS, 2, 0) + struct.pack("<2Q", T + 1, T + 1)
    head += b"byte-level".ljust(16, b"\0")
    assert len(head) == 64
    with open(out_tok, "wb") as f:
        f.write(head + struct.pack(f"<{2 * (T + 1)}H", *(train + val)))
    with open(out_raw, "wb") as f:
        f.write(struct.pack(f"<{T + 1}H", *train))


def read_splits(path, T):
    with open(path, "rb") as f:
        b = f.read()
    n_train, n_val = struct.unpack_from("<2Q", b, 32)
    assert n_train == n_val == T + 1
    toks = list(struct.unpack_from(f"<{n_train + n_val}H", b, 64))
    return {"train": toks[:T + 1], "val": toks[T + 1:]}


def layout(x):
    """Documents end AT the EOS: position restarts after each EOS; doc id counts the EOS before."""
    pos, doc, p, d = [], [], 0, 0
    for t, tok in enumerate(x):
        if t > 0 and x[t - 1] == EOS:
            p, d = 0, d + 1
        pos.append(p)
        doc.append(d)
        p += 1
    return pos, doc


def hf_loss(model, seq, document):
    import torch
    x, y = seq[:-1], seq[1:]
    ids = torch.tensor([x])
    kw = {}
    if document:
        pos, doc = layout(x)
        T = len(x)
        d = torch.tensor(doc)
        allowed = (d[None, :] == d[:, None]) & torch.tril(torch.ones(T, T, dtype=torch.bool))
        mask = torch.full((T, T), torch.finfo(torch.float32).min)
        mask[allowed] = 0.0
        kw = {"position_ids": torch.tensor([pos]), "attention_mask": mask[None, None]}
    with torch.no_grad():
        logits = model(ids, **kw).logits[0].double()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(y)).item()


def check(T, tok_path, hf_dir, runs):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    splits = read_splits(tok_path, T)
    ref = {(s, m): hf_loss(model, splits[s], m == "doc") for s in splits for m in ("doc", "causal")}
    for s in splits:
        gap = abs(ref[(s, "doc")] - ref[(s, "causal")])
        assert gap > 1e-3, f"{s}: document and causal references differ by only {gap}"
        print(f"ok: transformers {s} loss: document mask {ref[(s, 'doc')]:.7f}, causal {ref[(s, 'causal')]:.7f}")
    for arg in runs:
        name, path = arg.split("=", 1)
        mode = "doc" if name.startswith("doc") else "causal"
        recs = [json.loads(line) for line in open(path)]
        got = {"train": next(r["loss"] for r in recs if r.get("step") == 1 and "loss" in r),
               "val": [r["val_loss"] for r in recs if "val_loss" in r][-1]}
        tol = TOL_BF16 if "bf16" in name else TOL
        other = "causal" if mode == "doc" else "doc"
        for s in splits:
            want = ref[(s, mode)]
            rel = abs(got[s] - want) / abs(want)
            # bf16: within its tolerance, and nearer this mask's reference than the other mask's.
            ok = rel <= tol and abs(got[s] - want) < abs(got[s] - ref[(s, other)])
            print(f"{'ok' if ok else 'FAIL'}: {name} {s} loss {got[s]:.7f} vs transformers {want:.7f} "
                  f"(rel diff {rel:.1e}, tolerance {tol:g}; the other mask's {ref[(s, other)]:.7f})")
            if not ok:
                sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        check(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
