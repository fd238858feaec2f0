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
stored in the token file, with the directory's chat_template.jinja and generation_config.json, so
`--mode export` can hand the same tokenizer, template and generation settings to transformers.

Memory stays constant however large the corpus (up to the largest document): --workers processes
encode batches in order while the tokens stream to a temporary file, renamed into place at the end.

Chat data (issue 55): a JSONL file whose lines are {"messages": [...]} (optionally "tools") or
{"prompt": ..., "completion": ...} is recognized by its keys and written as format version 3: each
line one example, rendered by the model's own chat template (transformers' apply_chat_template;
--tokenizer must then be a model directory with a chat template), its ids stored as rendered, and
each token given a role class (context / assistant / end of turn): by the template's
{% generation %} markers where it has them, else by rendering prefixes of the conversation. The
validation split is the last floor(examples * --val-fraction) examples. The ids of the end-of-turn
tokens (<|im_end|>, <|eot_id|>) are listed in the metadata (examples.end_of_turn_ids): export adds
them to generation_config.json's eos_token_id. Templates that read the date need --date-string. See
docs/data-format.md, "Chat and prompt/completion data".
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

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
# Chat data: the roles a message may have, and the longest JSONL line read (bytes).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LINE_BYTES = int(os.environ.get("SHARDTRAIN_TOKENIZE_MAX_LINE_BYTES", 64 << 20))  # the variable: tests only
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
        if "generation_config.json" in files:  # refused here rather than by shardtrain's reader later
            try:
                st.check_generation_config(files["generation_config.json"], info["vocab_size"],
                                           f"'{os.path.join(path, 'generation_config.json')}'")
            except st.TokenFileError as e:
                raise Fail(str(e)) from None
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
# Chat and prompt/completion data (format version 3)


def jsonl_kind(files, text_field):
    """"chat", "prompt-completion" or "text": what the first record of the first JSONL input holds
    ({"messages": ...}; {"prompt": ..., "completion": ...}; anything else is text at --text-field)."""
    for path in files:
        if not is_jsonl(path):
            continue
        try:
            with _open(path) as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise Fail(f"{path}:{lineno}: not a JSON line: {e}")
                    return record_kind(rec, text_field)
        except (OSError, EOFError) as e:
            raise Fail(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}")
    return "text"


def record_kind(rec, text_field):
    if isinstance(rec, dict) and "messages" in rec and text_field not in rec:
        return "chat"
    if isinstance(rec, dict) and "prompt" in rec and "completion" in rec and text_field not in rec:
        return "prompt-completion"
    return "text"


def chat_records(files, kind, text_field):
    """Yields ((record, "file:line"), input_bytes) for every non-blank line; every line must be of
    `kind` and every input a JSONL file."""
    for path in files:
        if not is_jsonl(path):
            raise Fail(f"input '{path}' is not JSONL, but the inputs are {kind} data (one kind per token file)")
        gz = path.endswith(".gz")
        try:
            with _open(path) as f:
                lineno = 0
                while True:
                    line = f.readline(MAX_LINE_BYTES + 1)
                    if not line:
                        break
                    lineno += 1
                    if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                        raise Fail(f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES} bytes (one conversation per line)")
                    nb = 0 if gz else len(line)
                    if not line.strip():
                        yield None, nb
                        continue
                    try:
                        rec = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise Fail(f"{path}:{lineno}: not a JSON line: {e}")
                    got = record_kind(rec, text_field)
                    if got != kind:
                        raise Fail(f"{path}:{lineno}: a {got} record among {kind} data (one kind per token file)")
                    yield (rec, f"{path}:{lineno}"), nb
        except (OSError, EOFError) as e:
            raise Fail(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}")
        if gz:
            yield None, os.path.getsize(path)


def check_messages(msgs, where, what="messages"):
    if not isinstance(msgs, list) or not msgs:
        raise Fail(f"{where}: '{what}' is not a non-empty list of messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise Fail(f"{where}: {what}[{i}] is not an object")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise Fail(f"{where}: {what}[{i}] has role {role!r} (known: {', '.join(CHAT_ROLES)})")
        c = m.get("content")
        if not isinstance(c, str) and not (c is None and m.get("tool_calls")):
            raise Fail(f"{where}: {what}[{i}] ({role}) has no string 'content'")


class ChatRenderer:
    """Renders one record into (ids, roles) with the model's chat template (module docstring)."""

    def __init__(self, tok, template, date_string):
        import re
        self.tok, self.template = tok, template
        self.markers = bool(re.search(r"\{%-?\s*generation\s*-?%\}", template))
        self.kwargs = {}
        if date_string is not None:
            import datetime
            day = None
            for fmt in ("%d %b %Y", "%Y-%m-%d", "%d %B %Y"):
                try:
                    day = datetime.datetime.strptime(date_string, fmt)
                    break
                except ValueError:
                    pass
            self.kwargs = {"date_string": date_string}
            if "strftime_now" in template:
                # transformers compiles a template once (cached) with strftime_now among the Jinja
                # environment's globals; a template variable cannot replace it (arguments are made
                # plain data). Replaced in that environment, it formats the fixed day, so no
                # rendering reads the clock.
                try:
                    from transformers.utils import chat_template_utils as ctu
                    env = ctu._compile_jinja_template(template).environment
                    env.globals["strftime_now"] = (lambda f: day.strftime(f)) if day else _no_clock(date_string)
                except Exception as e:
                    raise Fail(f"the chat template reads today's date (strftime_now) and this transformers version "
                               f"does not let --date-string fix it ({type(e).__name__}: {_first_line(e)})")
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        self.special = {int(i) for i, t in added.items() if getattr(t, "special", False)} | set(tok.all_special_ids)

    def render(self, msgs, where, tools=None, **kw):
        try:
            return self.tok.apply_chat_template(msgs, tools=tools, tokenize=False, **self.kwargs, **kw)
        except Fail:
            raise
        except Exception as e:  # jinja2 errors, raise_exception() of the template
            line = getattr(e, "lineno", None)
            raise Fail(f"{where}: the chat template failed to render{f' (template line {line})' if line else ''}: "
                       f"{type(e).__name__}: {_first_line(e)}")

    def example(self, rec, where, kind):
        tools = rec.get("tools")
        if kind == "chat":
            msgs = rec["messages"]
            check_messages(msgs, where)
            first_target = 0
        else:
            p, c = rec["prompt"], rec["completion"]
            if isinstance(p, str) and isinstance(c, str):
                if tools is not None:
                    raise Fail(f"{where}: 'tools' with a string prompt and completion: no chat template renders "
                               f"them (give the prompt and completion as message lists)")
                return self.plain_pair(p, c)
            check_messages(p, where, "prompt")
            check_messages(c, where, "completion")
            msgs, first_target = p + c, len(p)
        if tools is not None and not isinstance(tools, list):
            raise Fail(f"{where}: 'tools' is not a list")
        full = self.render(msgs, where, tools)
        spans = []  # character spans of the assistant messages that are targets
        for i, m in enumerate(msgs):
            if m["role"] != "assistant" or i < first_target:
                continue
            if self.markers and kind == "chat":
                continue
            if i == 0:
                raise Fail(f"{where}: message 0 is an assistant message: without {{% generation %}} markers its "
                           f"answer is found by rendering the turns before it, and there are none (begin with a "
                           f"system or user turn, or give the template markers)")
            before = self.render(msgs[:i], where, tools, add_generation_prompt=True)
            upto = self.render(msgs[: i + 1], where, tools)
            if not (upto.startswith(before) and full.startswith(upto) and len(upto) > len(before)):
                raise Fail(f"{where}: message {i} (assistant): the chat template does not render the conversation as "
                           f"a growing prefix (it changes earlier turns, e.g. drops their reasoning), so the "
                           f"assistant tokens cannot be found; give it {{% generation %}} markers or another template")
            spans.append((len(before), len(upto)))
        if self.markers and kind == "chat":
            try:
                out = self.tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True, **self.kwargs)
            except Exception as e:
                raise Fail(f"{where}: the chat template failed to render: {type(e).__name__}: {_first_line(e)}")
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
            n_asst = sum(1 for m in msgs if m["role"] == "assistant")
            runs = sum(1 for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1]))
            if runs != n_asst:
                raise Fail(f"{where}: {n_asst} assistant message(s) but {runs} {{% generation %}} span(s) rendered: "
                           f"the template drops or merges assistant turns")
        else:
            enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
            ids, offs = list(enc["input_ids"]), enc["offset_mapping"]
            mask, k = [0] * len(ids), 0
            for t, (a, b) in enumerate(offs):  # transformers' rule: a token overlapping a span is in it
                while k < len(spans) and a >= spans[k][1]:
                    k += 1
                if k == len(spans):
                    break
                if b > spans[k][0]:
                    mask[t] = 1
        return ids, self.roles_of(ids, mask)

    def roles_of(self, ids, mask):
        """Role classes from an assistant mask: in each run of assistant tokens, the last special
        token followed only by whitespace is the end of turn (2); what follows it is markup (0)."""
        import numpy as np
        roles = np.zeros(len(ids), dtype=np.uint8)
        t = 0
        while t < len(ids):
            if not mask[t]:
                t += 1
                continue
            e = t
            while e < len(ids) and mask[e]:
                e += 1
            roles[t:e] = st.ROLE_ASSISTANT
            j = e - 1
            while j >= t and ids[j] not in self.special and not self.tok.decode([ids[j]]).strip():
                j -= 1
            if j >= t and ids[j] in self.special:
                roles[j] = st.ROLE_END_OF_TURN
                roles[j + 1:e] = st.ROLE_CONTEXT
            t = e
        return roles

    def plain_pair(self, prompt, completion):
        """String prompt/completion, as TRL tokenizes them: the prompt as the tokenizer encodes a text
        (its own special tokens, e.g. BOS, included; context), the completion without special tokens
        (assistant), then EOS (end of turn)."""
        import numpy as np
        tok = self.tok
        if tok.eos_token_id is None:
            raise Fail("prompt/completion strings need an EOS token to end the completion; the tokenizer has none")
        p = list(tok(prompt)["input_ids"])
        c = list(tok(completion, add_special_tokens=False)["input_ids"])
        ids = p + c + [tok.eos_token_id]
        roles = np.array([0] * len(p) + [1] * len(c) + [2], dtype=np.uint8)
        return ids, roles


def _first_line(e):
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _no_clock(date_string):
    def f(fmt):
        raise Fail(f"the chat template formats today's date (strftime_now) and --date-string '{date_string}' "
                   f"is not a date this script reads (26 Jul 2024, 2024-07-26)")
    return f


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


_C = {}


def _init_chat_worker(tok_dir, date_string, kind):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    _C.update(r=ChatRenderer(tok, chat_template_of(tok) or "", date_string), kind=kind)


def _encode_chat(item):
    """([(record, "file:line")], input_bytes) -> ([(ids, roles)], input_bytes)."""
    recs, nb = item
    return [_C["r"].example(rec, where, _C["kind"]) for rec, where in recs], nb


def chat_template_of(tok):
    t = getattr(tok, "chat_template", None)
    if isinstance(t, dict):  # named templates: the default one
        t = t.get("default")
    return t if isinstance(t, str) and t.strip() else None


def run_chat(a, files, kind, t_start):
    """Chat or prompt/completion JSONL -> format version 3 (module docstring)."""
    import hashlib
    if not os.path.isdir(a.tokenizer):
        raise Fail(f"the inputs are {kind} data: --tokenizer must be the model's directory (AutoTokenizer, with its "
                   f"chat template), not the file '{a.tokenizer}'")
    backend, info, tok_files = load_tokenizer(a.tokenizer)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    template = chat_template_of(tok)
    looked = ", ".join(os.path.join(a.tokenizer, f) for f in ("chat_template.jinja", "tokenizer_config.json"))
    if template is None and kind == "chat":
        raise Fail(f"the inputs are chat data, and the tokenizer has no chat template (looked at {looked})")
    if template and "strftime_now" in template and a.date_string is None:
        raise Fail("the chat template reads today's date (strftime_now, variable date_string): pass --date-string "
                   "(e.g. --date-string '26 Jul 2024') so that the token file does not depend on the day it was made")
    renderer = ChatRenderer(tok, template or "", a.date_string)
    vocab = info["vocab_size"]
    dtype = st.token_dtype(vocab)
    total_bytes = sum(os.path.getsize(f) for f in files)
    how = "{% generation %} markers" if renderer.markers else "prefix rendering"
    print(f"tokenize_hf: {len(files)} input file(s), {total_bytes / 1e6:.1f} MB of {kind} data; tokenizer {a.tokenizer} "
          f"(vocab {vocab}); chat template {'none' if template is None else how}; u{8 * dtype.itemsize} tokens; "
          f"{a.workers} worker(s)", file=sys.stderr)

    def grouped(it):
        recs, nb = [], 0
        for r, b in it:
            nb += b
            if r is not None:
                recs.append(r)
            if len(recs) >= a.batch_docs:
                yield recs, nb
                recs, nb = [], 0
        if recs or nb:
            yield recs, nb

    items = grouped(chat_records(files, kind, a.text_field))
    writer = st.TokenFileWriter(a.out, vocab, info["bos"], info["eos"], "hf-tokenizers", examples=True)
    n_ex = n_asst = 0
    pool = None
    try:
        if a.workers == 1:
            _C.update(r=renderer, kind=kind)
            results = map(_encode_chat, items)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            pool = ctx.Pool(a.workers, initializer=_init_chat_worker, initargs=(a.tokenizer, a.date_string, kind))
            results = pool.imap(_encode_chat, items, chunksize=1)
        for exs, _ in results:
            for ids, roles in exs:
                if len(ids) == 0:
                    continue
                writer.append(ids, roles)
                n_ex += 1
                n_asst += int((roles != st.ROLE_CONTEXT).sum())
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        if n_ex == 0:
            raise Fail("no examples in the inputs: nothing to write")
        import tokenizers
        import transformers
        meta = {
            "tokenizer": {"kind": "hf-tokenizers", "pad_id": info["pad"], "unk_id": info["unk"],
                          "add_bos": False, "add_eos": False, "source": info["source"]},
            "documents": n_ex,
            "inputs": len(files),
            "written_by": f"scripts/tokenize_hf.py (transformers {transformers.__version__}, tokenizers {tokenizers.__version__})",
        }
        ex = {"source": kind}
        if template is not None:
            ex["template"] = {"sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
                              "generation_markers": renderer.markers, "date_string": a.date_string}
            if "chat_template.jinja" not in tok_files:  # the template travels with the data, as transformers 5 saves it
                tok_files["chat_template.jinja"] = template.encode("utf-8")
        h = writer.finish(a.val_fraction, meta, tok_files, examples=ex)
    except BaseException:
        if pool is not None:
            pool.terminate()
        writer.abort()
        raise
    dt = time.time() - t_start
    n = h["n_train"] + h["n_val"]
    print(f"wrote {a.out} (format version 3): {n_ex} examples, {n} tokens (train {h['n_train']}, val {h['n_val']}), "
          f"{n_asst} assistant tokens ({100.0 * n_asst / max(n, 1):.1f}%), {len(files)} file(s), vocab {vocab} "
          f"(u{8 * dtype.itemsize}); {dt:.1f} s")
    return 0


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
                   help="last floor(n * f) tokens are the validation split (chat data: the last "
                   "floor(examples * f) examples; default 0.1)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoding processes (default: all cores)")
    p.add_argument("--batch-docs", type=int, default=1000, help="documents per batch sent to a worker")
    p.add_argument("--bos-id", type=int, help="BOS id to use instead of the tokenizer's")
    p.add_argument("--no-bos", action="store_true", help="no BOS before each document")
    p.add_argument("--eos-id", type=int, help="EOS id to use instead of the tokenizer's (required if it has none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--date-string", help="chat data: the date a template that reads today's date renders "
                   "(its date_string variable, e.g. '26 Jul 2024'), so the file never depends on the day it is made")
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
    kind = jsonl_kind(files, a.text_field)
    if kind != "text":
        return run_chat(a, files, kind, t_start)
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
