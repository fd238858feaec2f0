"""Writes the test corpus of test_tokenizer.sh into a directory: a training corpus (train.txt) and
documents to prepare: plain-text files and a .jsonl file, with non-ASCII text (é, 日本語, emoji),
whitespace runs (double spaces, tabs, trailing spaces, blank lines) and empty documents, and one
long document (several chunks when prepared with a tiny chunk size)."""
import json, os, random, sys

d = sys.argv[1]
os.makedirs(os.path.join(d, "docs"), exist_ok=True)
rng = random.Random(1234)
words = ("the quick brown fox jumps over lazy dog café résumé naïve 日本語 テキスト 東京 emoji 🙂 🚀 data model "
         "token 12345 3.14 2026 shard train loss value 42 hello world").split()

def sentence():
    n = rng.randint(3, 14)
    s = ""
    for i in range(n):
        s += rng.choice(words)
        s += rng.choice([" ", " ", " ", " ", "  ", "\t", ", ", ". ", " \t "]) if i < n - 1 else ""
    return s

with open(os.path.join(d, "train.txt"), "w", encoding="utf-8") as f:
    for _ in range(4000):
        f.write(sentence() + rng.choice(["\n", "\n", " \n", "\n\n"]))

docs = [
    "Hello world",
    " leading space and trailing spaces   ",
    "double  spaces,\ttabs\t\tand\n\nblank lines\n\n\n",
    "café 日本語 🙂🚀 émoji mix",
    "",  # empty document
    "  ",
    "\n",
    "digits 1234567890 and 3.14159",
    "unseen chars: Ω ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃",
]
docs += [" ".join(sentence() for _ in range(rng.randint(1, 5))) for _ in range(40)]
# One long document: many chunks at a 64-byte chunk size, with cut points and space runs.
docs.append("\n".join(sentence() for _ in range(300)))
# A long document without single spaces: cannot be cut, encoded whole.
docs.append("日本語テキスト" * 200)
# Plain-text files (one document each; not empty: prepare refuses empty files), the rest in JSONL.
plain = [x for x in docs if x][:6] + [docs[-2], docs[-1]]
jsonl = docs
for i, x in enumerate(plain):
    with open(os.path.join(d, "docs", "p%02d.txt" % i), "w", encoding="utf-8", newline="") as f:
        f.write(x)
with open(os.path.join(d, "docs", "z.jsonl"), "w", encoding="utf-8") as f:
    for x in jsonl:
        f.write(json.dumps({"id": 1, "text": x}, ensure_ascii=rng.random() < 0.5) + "\n")
    f.write("\n")  # a trailing blank line: no document
# The documents in prepare's order (directory sorted: p00..p07.txt, z.jsonl)
json.dump(plain + jsonl, open(os.path.join(d, "expected_docs.json"), "w"))
