#!/usr/bin/env python3
"""Tokenizes text with a Hugging Face tokenizer into a shardtrain token file (format version 2,
docs/data-format.md), for `shardtrain --data`.

    .venv/bin/python scripts/tokenize_hf.py --tokenizer path/to/tokenizer.json --out corpus.tok data/*.jsonl
    .venv/bin/python scripts/tokenize_hf.py --tokenizer path/to/model_dir --out corpus.tok books/ notes.txt

--tokenizer: a tokenizer.json file, or a directory that AutoTokenizer loads (local files only;
nothing is downloaded). Inputs: files, directories (every file below, in name order) and globs
("data/**/*.jsonl"). A *.jsonl / *.jsonl.gz file holds one document per line, the string at
--text-field ("text"); blank lines are skipped. Any other file is text (UTF-8, *.gz unpacked): the
whole file is one document (as `shardtrain --mode prepare`), or each line with --text-docs line.

Each document becomes BOS (when the tokenizer has one) + its ids (without the tokenizer's own
special tokens) + EOS; documents are concatenated in input order, and the last
floor(n * --val-fraction) tokens are the validation split. Ids are u16 when len(tokenizer) <= 65536,
else u32. The tokenizer's files (tokenizer.json, tokenizer_config.json, special_tokens_map.json) are
stored in the token file, so `--mode export` can hand the same tokenizer to AutoTokenizer.

Memory stays constant however large the corpus (up to the largest document): --workers processes
encode batches in order while the tokens stream to a temporary file, renamed into place at the end.
"""

import argparse
import glob
import gzip
import io
import json
import math
import multiprocessing as mp
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardtrain_tokens as st  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# For a bare tokenizer.json (no tokenizer_config.json to say which tokens are BOS and EOS), the
# usual names, first found wins.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class Fail(Exception):
    """An error for the user: printed as one line, exit status 1."""


# ---------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(path):
    """Returns (backend, info, files): backend a tokenizers.Tokenizer (what the workers use),
    info a dict of the special ids and where they came from, files name -> bytes to embed."""
    if not os.path.exists(path):
        raise Fail(f"tokenizer '{path}': no such file or directory")
    info = {"bos": None, "eos": None, "pad": None, "unk": None, "source": os.path.abspath(path)}
    if os.path.isdir(path):
        try:
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many kinds
            raise Fail(f"tokenizer '{path}': AutoTokenizer cannot load it: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            raise Fail(f"tokenizer '{path}': no fast tokenizer (tokenizers library) for it; "
                       "this script needs one (save it with a tokenizer.json)")
        info["vocab_size"] = len(tok)
        for k in ("bos", "eos", "pad", "unk"):
            info[k] = getattr(tok, f"{k}_token_id", None)
        info["how"] = "tokenizer_config.json"
        files = {}
        for name in TOKENIZER_FILES:
            p = os.path.join(path, name)
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    files[name] = f.read()
        if "tokenizer.json" not in files:  # converted from a slow tokenizer: store what we encode with
            files = {"tokenizer.json": backend.to_str().encode("utf-8"), **files}
        return backend, info, files
    try:
        from tokenizers import Tokenizer
        backend = Tokenizer.from_file(path)
    except Exception as e:
        raise Fail(f"tokenizer '{path}': not a loadable tokenizer.json: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    with open(path, "rb") as f:
        files = {"tokenizer.json": f.read()}
    info["vocab_size"] = backend.get_vocab_size(with_added_tokens=True)
    vocab = backend.get_vocab(with_added_tokens=True)
    # BOS: the first special token of a TemplateProcessing post-processor ("<|begin_of_text|> $A"),
    # else a usual name; EOS: a usual name.
    pp = json.loads(files["tokenizer.json"]).get("post_processor") or {}
    procs = pp.get("processors", [pp]) if pp.get("type") == "Sequence" else [pp]
    for p in procs:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            first = p["single"][0]
            if "SpecialToken" in first and first["SpecialToken"]["id"] in vocab:
                info["bos"] = vocab[first["SpecialToken"]["id"]]
    if info["bos"] is None:
        info["bos"] = next((vocab[n] for n in BOS_NAMES if n in vocab), None)
    info["eos"] = next((vocab[n] for n in EOS_NAMES if n in vocab), None)
    model = json.loads(files["tokenizer.json"]).get("model") or {}
    if model.get("unk_token") in vocab:
        info["unk"] = vocab[model["unk_token"]]
    info["how"] = "token names in tokenizer.json"
    return backend, info, files


# ---------------------------------------------------------------------------------------------
# Inputs


def expand_inputs(args_inputs, out_path):
    files = []
    for a in args_inputs:
        if os.path.isdir(a):
            found = []
            for root, dirs, names in os.walk(a):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(root, n) for n in names if not n.startswith(".")]
            found = sorted(f for f in found if os.path.isfile(f))
            if not found:
                raise Fail(f"input directory '{a}' holds no files")
            files += found
        elif os.path.isfile(a):
            files.append(a)
        elif any(c in a for c in "*?["):
            found = sorted(f for f in glob.glob(a, recursive=True) if os.path.isfile(f))
            if not found:
                raise Fail(f"input '{a}': the pattern matches no file")
            files += found
        elif os.path.exists(a):
            raise Fail(f"input '{a}': not a regular file or directory")
        else:
            raise Fail(f"input '{a}': no such file or directory")
    for f in files:
        if os.path.exists(out_path) and os.path.samefile(f, out_path):
            raise Fail(f"output '{out_path}' is also an input ('{f}'): refusing to overwrite it")
        if not os.access(f, os.R_OK):
            raise Fail(f"input '{f}': not readable (permission denied)")
    return files


def is_jsonl(path):
    return path.endswith((".jsonl", ".jsonl.gz"))


def _open(path):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def documents(files, text_field, text_docs):
    """Yields (text, input_bytes) per document, in order; input_bytes counts the file's bytes read
    for it (the progress bar's unit; compressed bytes for .gz, attributed at each file's end)."""
    for path in files:
        size = os.path.getsize(path)
        gz = path.endswith(".gz")
        try:
            with _open(path) as f:
                if is_jsonl(path):
                    for lineno, line in enumerate(f, 1):
                        nb = 0 if gz else len(line)
                        if not line.strip():
                            yield None, nb
                            continue
                        try:
                            rec = json.loads(line)
                        except (json.JSONDecodeError, UnicodeDecodeError) as e:
                            raise Fail(f"{path}:{lineno}: not a JSON line: {e}")
                        if not isinstance(rec, dict) or text_field not in rec:
                            raise Fail(f"{path}:{lineno}: no field '{text_field}' (--text-field)")
                        text = rec[text_field]
                        if not isinstance(text, str):
                            raise Fail(f"{path}:{lineno}: field '{text_field}' is {type(text).__name__}, not a string")
                        yield text, nb
                elif text_docs == "line":
                    for lineno, line in enumerate(io.TextIOWrapper(f, encoding="utf-8", newline=""), 1):
                        yield line.rstrip("\r\n"), 0 if gz else len(line.encode("utf-8"))
                else:
                    data = f.read()
                    try:
                        yield data.decode("utf-8"), 0 if gz else len(data)
                    except UnicodeDecodeError as e:
                        raise Fail(f"{path}: not UTF-8 text (byte {e.start}): {e.reason}")
        except UnicodeDecodeError as e:
            raise Fail(f"{path}: not UTF-8 text: {e.reason}")
        except (OSError, EOFError) as e:
            raise Fail(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}")
        if gz:
            yield None, size


def batches(docs, max_docs, max_bytes):
    """Groups documents into (texts, input_bytes) batches; None texts (skipped lines) only count bytes."""
    texts, nb, tb = [], 0, 0
    for text, b in docs:
        nb += b
        if text is not None:
            texts.append(text)
            tb += len(text)
        if len(texts) >= max_docs or tb >= max_bytes:
            yield texts, nb
            texts, nb, tb = [], 0, 0
    if texts or nb:
        yield texts, nb


# ---------------------------------------------------------------------------------------------
# Workers

_W = {}


def _init_worker(tok_str, bos, eos, dtype):
    from tokenizers import Tokenizer
    _W.update(tok=Tokenizer.from_str(tok_str), bos=bos, eos=eos, dtype=dtype)


def _encode(item):
    """(texts, input_bytes) -> (framed ids of the whole batch as one array, documents, input_bytes)."""
    import numpy as np
    texts, nb = item
    tok, bos, eos = _W["tok"], _W["bos"], _W["eos"]
    encs = tok.encode_batch(texts, add_special_tokens=False) if texts else []
    extra = (1 if bos is not None else 0) + 1
    out = np.empty(sum(len(e.ids) for e in encs) + extra * len(encs), dtype=_W["dtype"])
    i = 0
    for e in encs:
        if bos is not None:
            out[i] = bos
            i += 1
        ids = e.ids
        out[i:i + len(ids)] = ids
        i += len(ids)
        out[i] = eos
        i += 1
    return out, len(encs), nb


# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See docs/data-format.md.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="text or JSONL files, directories, globs")
    p.add_argument("--input", action="append", default=[], dest="more_inputs",
                   help="an input as with shardtrain --mode prepare (repeatable; same as a positional input)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json file or AutoTokenizer directory (local)")
    p.add_argument("--out", required=True, help="token file to write")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    p.add_argument("--text-docs", choices=("file", "line"), default="file",
                   help="a text file is one document (file, default) or one per line (line)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="last floor(n * f) tokens are the validation split (default 0.1)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoding processes (default: all cores)")
    p.add_argument("--batch-docs", type=int, default=1000, help="documents per batch sent to a worker")
    p.add_argument("--bos-id", type=int, help="BOS id to use instead of the tokenizer's")
    p.add_argument("--no-bos", action="store_true", help="no BOS before each document")
    p.add_argument("--eos-id", type=int, help="EOS id to use instead of the tokenizer's (required if it has none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    a.inputs = a.inputs + a.more_inputs
    if not a.inputs:
        p.error("no input: give text or JSONL files, directories or globs (positional or --input)")
    if not 0 <= a.val_fraction < 1:
        p.error(f"--val-fraction {a.val_fraction}: expected 0 <= f < 1")
    if a.workers < 1:
        p.error(f"--workers {a.workers}: expected >= 1")
    if a.batch_docs < 1:
        p.error(f"--batch-docs {a.batch_docs}: expected >= 1")
    return a


def run(a):
    t_start = time.time()
    out = a.out
    if os.path.isdir(out):
        raise Fail(f"output '{out}' is a directory; give a file name (e.g. {os.path.join(out, 'corpus.tok')})")
    od = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(od):
        raise Fail(f"output '{out}': directory '{od}' does not exist")
    files = expand_inputs(a.inputs, out)
    backend, info, tok_files = load_tokenizer(a.tokenizer)
    vocab = info["vocab_size"]
    bos = None if a.no_bos else (a.bos_id if a.bos_id is not None else info["bos"])
    eos = a.eos_id if a.eos_id is not None else info["eos"]
    if bos is not None and bos == eos and a.bos_id is None:
        bos = None  # GPT-2: "<|endoftext|>" is both; it separates documents, once
    if eos is None:
        raise Fail(f"tokenizer '{a.tokenizer}' has no EOS token ({info['how']}); pass --eos-id")
    for name, v in (("BOS", bos), ("EOS", eos)):
        if v is not None and not 0 <= v < vocab:
            raise Fail(f"{name} id {v} is outside the tokenizer's vocabulary (size {vocab})")
    dtype = st.token_dtype(vocab)
    total_bytes = sum(os.path.getsize(f) for f in files)
    name_of = lambda i: "none" if i is None else f"{i} {backend.id_to_token(i)!r}"  # noqa: E731
    print(f"tokenize_hf: {len(files)} input file(s), {total_bytes / 1e6:.1f} MB; tokenizer {a.tokenizer} "
          f"(vocab {vocab}, BOS {name_of(bos)}, EOS {name_of(eos)}); u{8 * dtype.itemsize} tokens; "
          f"{a.workers} worker(s)", file=sys.stderr)

    tok_str = backend.to_str()
    items = batches(documents(files, a.text_field, a.text_docs), a.batch_docs, 4 << 20)
    n_docs = 0
    writer = st.TokenFileWriter(out, vocab, bos, eos, "hf-tokenizers")
    pool = None
    try:
        from tqdm import tqdm
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, smoothing=0.1,
                   disable=True if a.quiet else None, file=sys.stderr, desc="tokenizing")
        if a.workers == 1:
            _init_worker(tok_str, bos, eos, dtype)
            results = map(_encode, items)
        else:
            # One thread per worker process (the workers are the parallelism); a bounded number of
            # batches in flight, so that the pool's feeder does not read the whole corpus ahead.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            slots = threading.BoundedSemaphore(4 * a.workers)

            def gated(it):
                for x in it:
                    slots.acquire()
                    yield x

            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            pool = ctx.Pool(a.workers, initializer=_init_worker, initargs=(tok_str, bos, eos, dtype))
            raw = pool.imap(_encode, gated(items), chunksize=1)

            def released(it):
                for r in it:
                    slots.release()
                    yield r

            results = released(raw)
        last = 0.0
        for ids, nd, nb in results:
            writer.append(ids)
            n_docs += nd
            bar.update(nb)
            now = time.time()
            if now - last > 0.5:
                bar.set_postfix_str(f"{writer.n / 1e6:.2f}M tok, {writer.n / max(now - t_start, 1e-9) / 1e3:.0f}k tok/s")
                last = now
        if bar.n < total_bytes:  # .gz files and skipped bytes: end at 100%
            bar.update(total_bytes - bar.n)
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        if writer.n == 0:
            raise Fail("no documents in the inputs: nothing to write")
        import tokenizers
        meta = {
            "tokenizer": {"kind": "hf-tokenizers", "pad_id": info["pad"], "unk_id": info["unk"],
                          "add_bos": bos is not None, "add_eos": True, "source": info["source"]},
            "documents": n_docs,
            "inputs": len(files),
            "written_by": f"scripts/tokenize_hf.py (tokenizers {tokenizers.__version__})",
        }
        h = writer.finish(a.val_fraction, meta, tok_files)
    except BaseException:
        if pool is not None:
            pool.terminate()
        writer.abort()
        raise
    dt = time.time() - t_start
    n = h["n_train"] + h["n_val"]
    print(f"wrote {out}: {n} tokens (train {h['n_train']}, val {h['n_val']}), {n_docs} documents from "
          f"{len(files)} file(s), vocab {vocab} (u{8 * dtype.itemsize}); {total_bytes / 1e6:.1f} MB in {dt:.1f} s "
          f"({total_bytes / 1e6 / max(dt, 1e-9):.1f} MB/s, {n / max(dt, 1e-9) / 1e3:.0f}k tokens/s)")
    return 0


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(a)
    except Fail as e:
        print(f"tokenize_hf: error: {e}", file=sys.stderr)
        return 1
    except st.TokenFileError as e:
        print(f"tokenize_hf: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tokenize_hf: interrupted; nothing written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
