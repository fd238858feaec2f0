"""Writes a byte-level token file of short packed documents: short_docs.py FILE N_TRAIN N_VAL
(STTOKv1, format version 1: vocabulary 258, BOS 256, EOS 257). Each document is BOS, 1-38 printable
bytes, EOS (3-40 tokens), random with seed 41; train and validation splits of N_TRAIN and N_VAL
tokens (a document may be cut at a split's end). The CP and document-mask tests' packed data
(tests/e2e/common.sh short_docs) and tests/bench/bitwise_ab.sh's."""
import random, struct, sys
path, n_train, n_val = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
BOS, EOS, V = 256, 257, 258
rnd = random.Random(41)
def split(n):
    out = []
    while len(out) < n:
        k = rnd.randrange(3, 41)
        out += [BOS] + [rnd.randrange(32, 127) for _ in range(k - 2)] + [EOS]
    return out[:n]
train, val = split(n_train), split(n_val)
head = b"STTOKv1\0" + struct.pack("<6I", 1, V, BOS, EOS, 2, 0) + struct.pack("<2Q", len(train), len(val))
head += b"byte-level".ljust(16, b"\0")
with open(path, "wb") as f:
    f.write(head + struct.pack(f"<{len(train) + len(val)}H", *(train + val)))
