"""A small mutational fuzzer over every file shardtrain reads from strangers (issue 27).

  fuzz.py BIN SEEDS OUT [--cases N] [--seed S] [--jobs J] [--targets a,b] [--np2 K]

SEEDS is a directory that tests/e2e/test_fuzz.sh filled with valid files made by shardtrain itself
(and an NFKC SentencePiece model made by Python's sentencepiece). Each target mutates one kind of
file (bit flips, interesting integers, truncation, chunk deletion and duplication, and for JSON
values and safetensors headers structured edits: huge and negative numbers, paths that leave the
directory, wrong types) and runs the reader on it. One case in ten of the JSON files and safetensors
headers is aimed instead at the limits of a bounded JSON reader (issue 53): nesting 10^3..10^5 deep,
a string of 1-4 MB, 10^5..10^6 elements, duplicate keys, NUL and invalid UTF-8 in strings and keys,
huge numbers, and in safetensors headers 10^3..5*10^4 empty tensors or a __metadata__ with 10^5
entries or nested 10^5 deep; every such file is under 5 MB, and its log begins with a "[limit: ...]"
line saying what was done. Every case runs under a timeout (60 s) and an address space limit
(ulimit -v, 4 GB), so that a hang or an allocation sized by the file shows as a failure.

Outcome of a case: exit 0 ("accepted"), or exit 1 with a line starting "shardtrain: error"
("refused"); anything else (a signal, another status, a refusal without the error line, a
timeout) is a failure, and its input, command and output are kept under OUT/failures/ for
reproduction. Cases are numbered; case i of target t uses its own random.Random(f"{seed}-{t}-{i}")
(and random.Random(f"{seed}-{t}-{i}-limit") to choose and make a limit edit, so that the other
cases are those of the fuzzer before limit edits existed), so any single case can be rerun
(--targets t --first i --cases 1). No state is shared between cases (the values the mutators hand
out are copies): a case's input does not depend on the cases before it. Standard library only.

An error of the harness itself (an exception in a mutator or in its file handling) is no failure of
shardtrain: it is printed as "fuzz harness error (not a shardtrain failure): ..." with the seed,
target, case and the command that reruns it, and the other cases still run. The summary gives, per
target, the cases run, accepted, refused, failed (shardtrain) and harness errors; the last line
reads "fuzz: N cases, A accepted, R refused, F failed, H harness errors in T s (...)". Exit status:
0 when every case was accepted or refused; bit 0 (1) set when shardtrain failed a case, bit 1 (2)
when the harness failed (2 also for an error outside the cases, and for bad arguments).

fuzz.py --self-test [SEEDS] checks the harness alone (no case runs; see self_test()).
"""
import argparse
import copy
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

INTERESTING_INTS = [0, 1, -1, 2**7, 2**8 - 1, 2**15, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1,
                    -(2**63), 2**64 - 1]
INTERESTING_VALUES = [0, -1, 1, 2**31, 2**32 + 64, 2**62, 2**63 - 1, 2**64 - 1, -(2**63), 1e308, -1.5, None, True,
                      "", "x", "/etc/passwd", "../../../../etc/passwd", "a/../../b", "model.safetensors", "\u0000",
                      "F32", "BF16", "I64", [], {}, [2**62, 4], [-1, 4], [0, 2**64 - 1], [[[[[]]]]], "a" * 5000]


def interesting_value(rng):
    """A fresh copy of one of INTERESTING_VALUES. Never the list's own object: a later edit of the
    case would change it for every case after (issue 53: a list appended into itself, json.dumps
    then failed with 'Circular reference detected', and cases depended on those run before)."""
    return copy.deepcopy(rng.choice(INTERESTING_VALUES))


# ---- mutations -------------------------------------------------------------------------------------
def mutate_bytes(rng, b, region=None):
    """1-4 random edits of `b`; within [lo, hi) when `region` is given (length kept)."""
    b = bytearray(b)
    lo, hi = region if region else (0, len(b))
    for _ in range(rng.randint(1, 4)):
        if hi <= lo:
            break
        op = rng.randrange(8 if region is None else 4)
        p = rng.randrange(lo, hi)
        if op == 0:  # bit flip
            b[p] ^= 1 << rng.randrange(8)
        elif op == 1:  # interesting byte
            b[p] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, 0x3A, 0x2F, 0x2E])
        elif op in (2, 3):  # interesting 4- or 8-byte little-endian integer
            n = 4 if op == 2 else 8
            v = rng.choice(INTERESTING_INTS) & ((1 << (8 * n)) - 1)
            p = min(p, max(lo, hi - n))
            b[p:p + n] = v.to_bytes(n, "little")[: max(0, hi - p)]
        elif op == 4:  # truncate
            del b[p:]
            hi = len(b)
        elif op == 5:  # delete a chunk
            del b[p:p + rng.randint(1, 64)]
            hi = len(b)
        elif op == 6:  # duplicate a chunk elsewhere
            q = rng.randrange(len(b))
            b[p:p] = b[q:q + rng.randint(1, 64)]
            hi = len(b)
        else:  # random bytes
            b[p:p + 8] = bytes(rng.randrange(256) for _ in range(8))
            hi = len(b)
    return bytes(b)


def mutate_json_value(rng, v, depth=0):
    """`v` (parsed JSON) with one random node replaced, deleted or duplicated."""
    if isinstance(v, dict) and v and (depth == 0 or rng.random() < 0.8):
        k = rng.choice(list(v))
        r = rng.random()
        if r < 0.1:
            del v[k]
        elif r < 0.2:
            v[k + rng.choice(["_", ".x", "/../x"])] = v[k]
        else:
            v[k] = mutate_json_value(rng, v[k], depth + 1)
        return v
    if isinstance(v, list) and v and rng.random() < 0.8:
        i = rng.randrange(len(v))
        r = rng.random()
        if r < 0.1:
            del v[i]
        elif r < 0.2:
            v.append(v[i])
        else:
            v[i] = mutate_json_value(rng, v[i], depth + 1)
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool) and rng.random() < 0.3:
        return v + rng.choice([-1, 1, 2**32])
    return interesting_value(rng)


# ---- mutations aimed at a bounded JSON reader's limits (issue 53) -------------------------------------
# One case in LIMIT_RATE of the JSON targets and of the safetensors target gets one of these instead
# of the edits above: deep nesting, a long string, many elements, duplicate keys, NUL or invalid
# UTF-8 in a string or key, huge numbers, and in a safetensors header many tiny entries or a deep
# __metadata__. They are drawn from the case's second generator (`lim`), so every other case is the
# same as before they existed. Python's json can write neither 10^5 nested arrays (recursion) nor
# duplicate keys, raw NUL bytes or invalid UTF-8: the edit puts a marker string in the parsed value
# and dumps_raw() replaces the marker in the text by the raw bytes. Each payload is under 5 MB.
LIMIT_RATE = 0.1
MARK = "\u0000fuzz-raw-%d\u0000"  # never in a seed's text: json.dumps writes its NULs as \u0000
LIMIT_KINDS = ("deep", "long_string", "many", "dup_keys", "bad_string", "huge_number")

# Inside a string (between its quotes): NUL, invalid or overlong UTF-8, lone surrogates, control bytes.
BAD_STRING_BYTES = [b"a\x00b", b"\x00", b"\xff", b"\xfe\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                    b"\xe2\x82", b"a\x80b", b"\\u0000", b"\\ud800", b"\\udc00\\ud800", b"\x01\x1f", b"\\uZZZZ"]


def limit_payload(rng, kind):
    """Raw JSON text (bytes) of one value aimed at a limit of kind `kind` (one of LIMIT_KINDS)."""
    if kind == "deep":  # 10^3..10^5 nested arrays or objects, closed or (one in 10) left open
        d = int(10 ** rng.uniform(3, 5))
        open_, close = rng.choice([(b"[", b"]"), (b'{"a":', b"}"), (b'[{"a":', b"}]")])
        inner = b"0" if open_.endswith(b":") else b""
        return open_ * d + inner + (close * d if rng.random() < 0.9 else b"")
    if kind == "long_string":  # 1..4 MB of text, or of escapes
        n = rng.randint(1 << 20, 4 << 20)
        if rng.random() < 0.7:
            return b'"' + b"a" * n + b'"'
        esc = rng.choice([b"\\u00e9", b"\\n", b"\\ud83d\\ude00"])
        return b'"' + esc * (n // len(esc)) + b'"'
    if kind == "many":  # an array of 10^5..10^6 small items, or an object of 10^5..3*10^5 keys
        if rng.random() < 0.6:
            item = rng.choice([b"0", b"1", b'""', b"[]", b"{}", b"null"])
            n = min(int(10 ** rng.uniform(5, 6)), (4 << 20) // (len(item) + 1))
            return b"[" + b",".join([item] * n) + b"]"
        n = int(10 ** rng.uniform(5, 5.5))
        return b"{" + b",".join(b'"k%d":0' % i for i in range(n)) + b"}"
    if kind == "dup_keys":  # one key twice, or 10^3..10^5 times
        n = 2 if rng.random() < 0.5 else int(10 ** rng.uniform(3, 5))
        return b"{" + b",".join(b'"a":%d' % i for i in range(n)) + b"}"
    if kind == "bad_string":
        return b'"' + rng.choice(BAD_STRING_BYTES) + b'"'
    assert kind == "huge_number", kind
    return rng.choice([b"1" + b"0" * rng.choice([19, 20, 39, 309, 400, 10**5]),
                       b"-" + b"9" * rng.choice([19, 20, 400, 10**5]), b"1e999999999", b"-1e-999999999",
                       b"1E+2147483648", b"0." + b"0" * 10**5 + b"1", b"18446744073709551616",
                       b"9223372036854775808", b"-9223372036854775809", b"-0", b"1" * 10**5 + b".5e-3"])


def note(rng, text):
    """Records what a limit edit did in `rng.notes` (run_case writes it into the case's log)."""
    if hasattr(rng, "notes"):
        rng.notes.append(text)


def limit_edit(rng, v, raws):
    """`v` (parsed JSON) with one node (the root one time in 20) replaced by the marker of a raw limit payload,
    or one key of an object written twice or given bad bytes; each marker is appended to `raws` as
    (marker, raw bytes, whether the marker lies inside a string)."""
    parent, key, node, path = None, None, v, []
    while isinstance(node, (dict, list)) and node and rng.random() < (0.95 if parent is None else 0.6):
        parent = node
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        node = parent[key]
        path.append(str(key))
    where = "/".join(path) or "the root"
    m = MARK % len(raws)
    if isinstance(parent, dict) and rng.random() < 0.3:
        if rng.random() < 0.6:  # "k": old, ..., "k": new (which one a reader keeps is its choice)
            raws.append((m, b"", True))
            parent[key + m] = interesting_value(rng) if rng.random() < 0.5 else copy.deepcopy(node)
            note(rng, f"limit: key {where} written twice")
        else:  # "k<bad bytes>": old
            raws.append((m, rng.choice(BAD_STRING_BYTES), True))
            parent[key + m] = parent.pop(key)
            note(rng, f"limit: key {where} given the bytes {raws[-1][1]!r}")
        return v
    kind = rng.choice(LIMIT_KINDS)
    raws.append((m, limit_payload(rng, kind), False))
    note(rng, f"limit: {where} replaced by {kind} payload {raws[-1][1][:24]!r}.. ({len(raws[-1][1])} bytes)")
    if parent is None:
        return m
    parent[key] = m
    return v


def limit_header(rng, h, raws):
    """A safetensors header (parsed) aimed at limits: 10^3..5*10^4 tiny (empty) tensors, a
    __metadata__ of 10^3..10^5 entries or nested 10^3..10^5 deep, or else a limit_edit."""
    r = rng.random()
    if r < 0.25 and isinstance(h, dict):
        n = int(10 ** rng.uniform(3, 4.7))
        for i in range(n):
            h[f"fuzz.{i}"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
        note(rng, f"limit: {n} empty tensors added to the header")
        return h
    if r < 0.5 and isinstance(h, dict):
        m = MARK % len(raws)
        if rng.random() < 0.5:
            n = int(10 ** rng.uniform(3, 5))
            raws.append((m, b"{" + b",".join(b'"k%d":"v"' % i for i in range(n)) + b"}", False))
            note(rng, f"limit: __metadata__ of {n} entries")
        else:
            d = int(10 ** rng.uniform(3, 5))
            raws.append((m, b'{"a":' * d + b'"v"' + b"}" * d, False))
            note(rng, f"limit: __metadata__ nested {d} deep")
        h["__metadata__"] = m
        return h
    return limit_edit(rng, h, raws)


def dumps_raw(v, raws):
    """json.dumps(v), each marker of `raws` replaced by its raw bytes."""
    s = json.dumps(v).encode()
    for m, raw, in_string in raws:
        m = json.dumps(m).encode()
        s = s.replace(m[1:-1] if in_string else m, raw)
    return s


def mutate_json(rng, b, lim=None):
    """A JSON file: its value edited (mutate_json_value, 1-2 times), or its bytes; one case in
    LIMIT_RATE (drawn from `lim`) aimed at a limit instead (limit_edit)."""
    try:
        v = json.loads(b)
    except ValueError:
        return mutate_bytes(rng, b)
    if lim is not None and lim.random() < LIMIT_RATE:
        raws = []
        return dumps_raw(limit_edit(lim, v, raws), raws)
    if rng.random() < 0.75:
        for _ in range(rng.randint(1, 2)):
            v = mutate_json_value(rng, v)
        return json.dumps(v).encode()
    return mutate_bytes(rng, b)


def mutate_safetensors(rng, b, lim=None):
    """Structured (header JSON edited, length re-encoded, padded to 8) or raw; one case in
    LIMIT_RATE (drawn from `lim`) with a header aimed at limits (limit_header)."""
    limit = lim is not None and lim.random() < LIMIT_RATE
    if (limit or rng.random() < 0.6) and len(b) >= 8:
        n = struct.unpack_from("<Q", b)[0]
        try:
            h = json.loads(b[8:8 + n])
        except ValueError:
            return mutate_bytes(rng, b)
        raws = []
        h = limit_header(lim, h, raws) if limit else mutate_json_value(rng, h)
        hs = dumps_raw(h, raws)
        hs += b" " * (-len(hs) % 8)
        return struct.pack("<Q", len(hs)) + hs + b[8 + n:]
    return mutate_bytes(rng, b)


def proto_fields(b):
    """[(field, wire_type, start, end)] of a protobuf message; end of value bytes (wire type 2)."""
    out, p = [], 0

    def varint(p):
        v, s = 0, 0
        while p < len(b):
            c = b[p]
            p += 1
            v |= (c & 0x7F) << s
            s += 7
            if not c & 0x80:
                return v, p
        raise ValueError("truncated varint")

    while p < len(b):
        key, p = varint(p)
        wt = key & 7
        if wt == 0:
            _, p2 = varint(p)
        elif wt == 1:
            p2 = p + 8
        elif wt == 5:
            p2 = p + 4
        elif wt == 2:
            n, p = varint(p)
            p2 = p + n
        else:
            raise ValueError("wire type")
        out.append((key >> 3, wt, p, p2))
        p = p2
    return out


def charsmap_region(b):
    """[start, end) of normalizer_spec.precompiled_charsmap in a SentencePiece model, or None."""
    for f, wt, s, e in proto_fields(b):
        if f == 3 and wt == 2:
            for f2, wt2, s2, e2 in proto_fields(b[s:e]):
                if f2 == 2 and wt2 == 2 and e2 > s2:
                    return (s + s2, s + e2)
    return None


def mutate_sentencepiece(rng, b):
    """Raw, or (half the time, for a model with a charsmap) inside its precompiled_charsmap: the
    trie size, trie units and normalized strings, the blob's length kept so the proto stays valid."""
    region = charsmap_region(b)
    if region and rng.random() < 0.6:
        s, e = region
        b = bytearray(b)
        if rng.random() < 0.3:  # the trie size: past the blob, or a little short
            size = struct.unpack_from("<I", b, s)[0]
            struct.pack_into("<I", b, s, rng.choice([e - s, e - s - 1, e - s + 4, size + 4, size - 4, 2**31, 0, 4]) & 0xFFFFFFFF)
            return bytes(b)
        return mutate_bytes(rng, bytes(b), (s, e))
    return mutate_bytes(rng, b)


# ---- targets ---------------------------------------------------------------------------------------
def raw_only(mutate):
    """mutate(rng, b) as a target's mutate(rng, b, lim): no edit aimed at a JSON reader's limits."""
    return lambda rng, b, lim: mutate(rng, b)


def targets(bin_path, seeds, np2_every):
    """name -> (seeds [(kind, path under SEEDS)], mutate(rng, bytes, lim), commands(rng, case_dir, file), is_dir):
    a case copies one seed (with is_dir, its whole directory, as case_dir/hf), mutates it, and runs
    the commands in order until one does not exit 0."""
    mpirun = ["mpirun", "--oversubscribe", "-np", "2"]

    def sp(rng, d, f):  # a SentencePiece model: loaded and used to encode (prepare)
        return [[bin_path, "--mode", "prepare", "--tokenizer", f, "--input", f"{seeds}/text.txt", "--out", f"{d}/x.tok"]]

    def hf(rng, d, f):  # an HF directory: import; a model that imports is then run (its tokenizer encodes)
        ck = f"{d}/x.h5"
        cmds = [[bin_path, "--mode", "import", "--hf-dir", f"{d}/hf", "--out", ck]]
        prompt = ["--prompt", "Hello, world. x"] if os.path.exists(f"{d}/hf/tokenizer.model") else ["--prompt-ids", "1,2"]
        cmds.append([bin_path, "--mode", "generate", ck, *prompt, "--max-new-tokens", "2"])
        return cmds

    def ckpt(rng, d, f):  # a checkpoint: inspect, export or resume (a handful at 2 ranks)
        which = rng.randrange(3)
        pre = mpirun if np2_every and rng.randrange(np2_every) == 0 else []
        if which == 0:
            return [pre + [bin_path, "--mode", "inspect", f]]
        if which == 1:
            return [pre + [bin_path, "--mode", "export", f, "--out", f"{d}/exp"]]
        return [pre + [bin_path, "--model", "tiny", "--data", f"{seeds}/c.tok", "--seq-len", "16", "--global-batch", "2",
                       "--steps", "3", "--eval-batches", "1", "--threads", "1", "--resume", f,
                       "--checkpoint-dir", f"{d}/ck"]]

    def tok(rng, d, f):  # a token file: a short training run reads it
        extra = ["--data-format", "nanogpt"] if f.endswith(".bin") and "nanogpt" in f else []
        val = ["--val-data", f] if f.endswith(".bin") else []
        return [[bin_path, "--model", "tiny", "--data", f, *val, *extra, "--seq-len", "8", "--global-batch", "1",
                 "--steps", "1", "--eval-batches", "1", "--threads", "1"]]

    def ini(rng, d, f):  # a job file: options parsed, the plan printed
        return [[bin_path, "--config", f, "--mode", "plan"]]

    return {
        "sentencepiece": ([("sp", "sp_identity.model"), ("sp", "sp_nfkc.model")], raw_only(mutate_sentencepiece), sp, False),
        "safetensors": ([("hf", "hf_single/model.safetensors")], mutate_safetensors, hf, True),
        "index": ([("hf", "hf_sharded/model.safetensors.index.json")], mutate_json, hf, True),
        "config": ([("hf", "hf_single/config.json"), ("hf", "hf_sp/generation_config.json")], mutate_json, hf, True),
        "hf_tokenizer": ([("hf", "hf_sp/tokenizer.model"), ("hf", "hf_single/tokenizer.json")],
                         lambda rng, b, lim: mutate_sentencepiece(rng, b) if b[:1] != b"{" else mutate_json(rng, b, lim), hf, True),
        "checkpoint": ([("ck", "ckpt.h5")], raw_only(mutate_bytes), ckpt, False),
        "token_file": ([("tok", "c.tok"), ("tok", "llmc.bin"), ("tok", "nanogpt.bin"), ("tok", "chat.tok")],
                       raw_only(mutate_bytes), tok, False),
        "ini": ([("ini", "job.ini")], raw_only(mutate_bytes), ini, False),
    }


def run_case(args, name, spec, i):
    seeds_list, mutate, commands, is_dir = spec
    rng = random.Random(f"{args.seed}-{name}-{i}")
    kind, rel = rng.choice(seeds_list)
    case = tempfile.mkdtemp(prefix=f"{name}-{i}-", dir=args.tmp)
    try:
        src = os.path.join(args.seeds, rel)
        if is_dir:  # copy the seed directory as 'hf', mutate one file in it
            shutil.copytree(os.path.dirname(src), os.path.join(case, "hf"))
            f = os.path.join(case, "hf", os.path.basename(src))
        else:
            f = os.path.join(case, os.path.basename(src))
            shutil.copy(src, f)
        data = open(f, "rb").read()
        lim = random.Random(f"{args.seed}-{name}-{i}-limit")
        lim.notes = []
        open(f, "wb").write(mutate(rng, data, lim))
        outcome, log = "accepted", "".join(f"[{n}]\n" for n in lim.notes)
        # Open MPI's session directory in the case's own directory: in the shared /tmp/ompi.HOST.UID,
        # one job's clean-up removes the directory while another job starts in it ('A call to mkdir
        # was unable to create the desired directory ... orte_init failed', exit 1, seen in 1 of
        # 320 cases with other MPI jobs on the machine), a false failure of shardtrain.
        env = dict(args.env, OMPI_MCA_orte_tmpdir_base=case)
        for cmd in commands(rng, case, f):
            # ulimit -v, not prlimit --as: under prlimit the program crashed at start-up even with 1 TiB.
            full = ["bash", "-c", 'ulimit -v "$0" && exec "$@"', str(args.as_kib), *cmd]
            try:
                p = subprocess.run(full, cwd=case, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   timeout=args.timeout, env=env)
                out, rc = p.stdout.decode(errors="replace"), p.returncode
            except subprocess.TimeoutExpired as e:
                out, rc = (e.stdout or b"").decode(errors="replace"), "timeout"
            log += f"$ {' '.join(cmd)}\n{out}\n[exit {rc}]\n"
            if rc == 0:
                continue
            if rc == 1 and any(line.startswith("shardtrain: error") for line in out.splitlines()):
                outcome = "refused"
                break
            outcome = "failed"
            break
        if outcome == "failed":
            keep = os.path.join(args.out, "failures", f"{name}-{i}")
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(case, keep, ignore=shutil.ignore_patterns("*.h5.tmp", "exp", "ck", "ompi.*"))
            open(os.path.join(keep, "log.txt"), "w").write(log)
        return name, i, outcome, log
    finally:
        shutil.rmtree(case, ignore_errors=True)


def run_case_guarded(args, name, spec, i):
    """run_case, an exception of the harness itself (not of shardtrain) turned into outcome
    "harness" with its traceback, so that the cases after it still run."""
    try:
        return run_case(args, name, spec, i)
    except Exception:
        return name, i, "harness", traceback.format_exc()


# ---- self-test of the harness (issue 53) ----------------------------------------------------------
SAMPLE_JSON = [  # small documents of the shapes the JSON targets read (config, index, tokenizer.json)
    b'{"vocab_size": 512, "hidden_size": 16, "num_hidden_layers": 1, "rope_theta": 10000.0, "eos_token_id": [1, 2],'
    b' "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}, "tie_word_embeddings": false, "x": null}',
    b'{"metadata": {"total_size": 4096}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",'
    b' "lm_head.weight": "model-00002-of-00002.safetensors"}}',
    b'{"version": "1.0", "added_tokens": [{"id": 0, "content": "<s>", "special": true}], "model": {"type": "BPE",'
    b' "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"], [[], [[]]]]}, "pre_tokenizer": null}',
    b'[[[1, 2], [3]], [], {"a": [[], {}]}, "s", 1.5]',
]


def containers(v):
    """Every list and dict in `v` (parsed JSON), each once (a shared one is met once)."""
    seen, stack, out = set(), [v], []
    while stack:
        x = stack.pop()
        if isinstance(x, (list, dict)) and id(x) not in seen:
            seen.add(id(x))
            out.append(x)
            stack.extend(x.values() if isinstance(x, dict) else x)
    return out


def check_limit_payload(kind, p):
    """Asserts that limit payload `p` (bytes) of kind `kind` reaches its limit."""
    what = f"{kind} payload {p[:40]!r}.. ({len(p)} bytes)"
    if kind == "deep":
        depth = top = 0
        for c in p:
            depth += (c in b"[{") - (c in b"]}")
            top = max(top, depth)
        assert top >= 1000, f"{what}: nesting depth {top}"
    elif kind == "long_string":
        assert len(p) >= 1 << 20, what
    elif kind == "many":
        assert p.count(b",") >= 10**5 - 1, what
    elif kind == "dup_keys":
        keys = [k for k, _ in json.loads(p, object_pairs_hook=lambda pairs: pairs)]
        assert len(keys) > len(set(keys)), what
    elif kind == "bad_string":
        try:
            v = json.loads(p)
        except ValueError:  # invalid UTF-8 or a raw control byte: Python refuses it
            return
        assert "\x00" in v or any(0xD800 <= ord(c) < 0xE000 for c in v), what
    else:
        f = float(p)
        assert f == 0 or abs(f) >= 2**63, what


def self_test(seeds=None, cases=300):
    """The harness's own check, run by test_fuzz.sh before any case: the JSON and safetensors
    mutators, applied `cases` times to each sample (and seed, when SEEDS is given) with fixed seeds,
    never raise, return bytes, hand out no object of INTERESTING_VALUES (each value in a mutated
    tree is a copy) and leave INTERESTING_VALUES unchanged; a case's bytes do not depend on the cases
    run before it (forward and reverse order agree); markers of dumps_raw() are all replaced, some
    cases aim at limits, and each kind of limit payload reaches its limit (check_limit_payload) under
    5 MB; a mutator's exception is a harness error. Raises AssertionError on the first violation."""
    snapshot = repr(INTERESTING_VALUES)
    shared = {id(x) for x in containers(INTERESTING_VALUES)}
    docs = [(f"sample{k}", b, mutate_json) for k, b in enumerate(SAMPLE_JSON)]
    for rel, mutate in (("hf_single/config.json", mutate_json), ("hf_single/tokenizer.json", mutate_json),
                        ("hf_sharded/model.safetensors.index.json", mutate_json),
                        ("hf_single/model.safetensors", mutate_safetensors)):
        if seeds:
            docs.append((rel, open(os.path.join(seeds, rel), "rb").read(), mutate))
    for name, b, mutate in docs:
        if mutate is mutate_json:  # the edits of the parsed value, as mutate_json makes them (twice)
            for i in range(cases):
                rng, v = random.Random(f"self-test-{name}-{i}-tree"), json.loads(b)
                for _ in range(2):
                    v = mutate_json_value(rng, v)
                    hit = [x for x in containers(v) if id(x) in shared]
                    assert not hit, f"{name} case {i}: mutate_json_value handed out INTERESTING_VALUES' own {hit[0]!r:.80}"
                json.dumps(v)  # the failure: 'Circular reference detected'
        outs, limited = {}, 0
        for i in list(range(cases)) + list(reversed(range(cases // 4))):
            try:
                out = mutate(random.Random(f"self-test-{name}-{i}"), b, random.Random(f"self-test-{name}-{i}-limit"))
            except Exception as e:
                raise AssertionError(f"{name} case {i}: {mutate.__name__} raised {type(e).__name__}: {e}") from e
            assert isinstance(out, bytes), f"{name} case {i}: {mutate.__name__} returned {type(out).__name__}"
            assert b"fuzz-raw" not in out, f"{name} case {i}: a marker of dumps_raw() is left in the output"
            assert len(out) < 2 * len(b) + (5 << 20), f"{name} case {i}: {len(out)} bytes"
            digest = hashlib.sha256(out).digest()
            assert outs.setdefault(i, digest) == digest, f"{name} case {i}: its bytes depend on the cases run before it"
            limited += len(out) > len(b) + 4000
        assert repr(INTERESTING_VALUES) == snapshot, f"INTERESTING_VALUES changed by the mutations of {name}"
        assert limited, f"{name}: no case aimed at a limit in {cases}"
    # Each kind of limit payload reaches its limit, under 5 MB.
    for kind in LIMIT_KINDS:
        for i in range(12):
            p = limit_payload(random.Random(f"self-test-{kind}-{i}"), kind)
            assert len(p) < 5 << 20, f"{kind} {i}: {len(p)} bytes"
            check_limit_payload(kind, p)
    # A mutator that raises makes a harness error of its case, not a failure, and no exception.
    with tempfile.TemporaryDirectory() as tmp:
        open(os.path.join(tmp, "seed.json"), "wb").write(SAMPLE_JSON[0])

        def broken(rng, b, lim):
            raise ValueError("Circular reference detected")
        args = argparse.Namespace(seed="self-test", seeds=tmp, tmp=tmp, out=tmp)
        spec = ([("x", "seed.json")], broken, lambda rng, d, f: [["true"]], False)
        _, _, outcome, log = run_case_guarded(args, "x", spec, 0)
        assert outcome == "harness" and "Circular reference" in log, f"a mutator's exception gave {outcome!r}"
    print(f"fuzz self-test: ok ({len(docs)} documents x {cases} cases, the first {cases // 4} again in reverse order)")


def rerun_command(args, name, i):
    return (f"{sys.executable} {os.path.abspath(__file__)} {args.bin} {args.seeds} {args.out} --seed {args.seed} "
            f"--targets {name} --first {i} --cases 1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin", nargs="?")
    ap.add_argument("seeds", nargs="?")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--self-test", nargs="?", const="", metavar="SEEDS",
                    help="check the harness itself (on samples, and the seeds of SEEDS when given), run no case")
    ap.add_argument("--cases", type=int, default=int(os.environ.get("FUZZ_CASES", "0")) or None,
                    help="cases in all, spread over the targets (default: 40 per target)")
    ap.add_argument("--first", type=int, default=0, help="number of the first case of each target")
    ap.add_argument("--seed", default=os.environ.get("FUZZ_SEED", "27"))
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("FUZZ_JOBS", "2")))
    ap.add_argument("--targets", default="")
    ap.add_argument("--np2", type=int, default=10, help="one checkpoint case in K runs at 2 ranks (0: none)")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--as-kib", type=int, default=4_000_000, help="address space limit of each command (ulimit -v, KiB)")
    args = ap.parse_args()
    if args.self_test is not None:
        self_test(args.self_test or None)
        return 0
    if not args.out:
        ap.error("BIN, SEEDS and OUT are required (or --self-test)")
    args.bin = os.path.abspath(args.bin)
    args.seeds = os.path.abspath(args.seeds)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    args.tmp = tempfile.mkdtemp(prefix="fuzz-", dir=os.environ.get("TMPDIR", "/tmp"))
    args.env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_vader_single_copy_mechanism="none",
                    OMPI_MCA_odls_base_sigkill_timeout="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    ts = targets(args.bin, args.seeds, args.np2)
    names = [t for t in ts if not args.targets or t in args.targets.split(",")]
    per = max(1, (args.cases + len(names) - 1) // len(names)) if args.cases else 40
    work = [(n, i) for i in range(args.first, args.first + per) for n in names]
    t0 = time.time()
    kinds = ("accepted", "refused", "failed", "harness")
    counts = {n: dict.fromkeys(kinds, 0) for n in names}
    failed, harness = [], []
    with ThreadPoolExecutor(args.jobs) as ex:
        for name, i, outcome, log in ex.map(lambda w: run_case_guarded(args, w[0], ts[w[0]], w[1]), work):
            counts[name][outcome] += 1
            done = sum(sum(c.values()) for c in counts.values())
            if done % 250 == 0:
                print(f"  ... {done}/{len(work)} cases, {sum(c['failed'] for c in counts.values())} failed, "
                      f"{time.time() - t0:.0f} s", flush=True)
            if outcome == "failed":
                failed.append(f"{name}-{i}")
                print(f"FAILED {name} case {i}: input and log in {args.out}/failures/{name}-{i}\n{log[-2000:]}", flush=True)
            elif outcome == "harness":
                harness.append(f"{name}-{i}")
                print(f"fuzz harness error (not a shardtrain failure): target {name} case {i} (seed {args.seed}): "
                      f"{log.strip().splitlines()[-1]}\n{log}rerun: {rerun_command(args, name, i)}", flush=True)
    shutil.rmtree(args.tmp, ignore_errors=True)
    for n in names:
        c = counts[n]
        print(f"  {n:14s} {sum(c.values()):5d} cases: {c['accepted']} accepted, {c['refused']} refused, "
              f"{c['failed']} failed, {c['harness']} harness errors")
    tot = {k: sum(c[k] for c in counts.values()) for k in kinds}
    ran = sum(tot.values())
    assert ran == len(work), f"{ran} of {len(work)} cases reported"
    if failed:
        print(f"shardtrain failed {len(failed)} cases: {' '.join(failed)}")
    if harness:
        print(f"fuzz harness error (not a shardtrain failure) in {len(harness)} cases: {' '.join(harness)}")
    print(f"fuzz: {len(work)} cases, {tot['accepted']} accepted, {tot['refused']} refused, {tot['failed']} failed, "
          f"{tot['harness']} harness errors in {time.time() - t0:.0f} s (seed {args.seed}, {args.jobs} jobs)")
    return (1 if failed else 0) | (2 if harness else 0)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # the harness's own bug: never reported as shardtrain's
        print(f"fuzz harness error (not a shardtrain failure):\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(2)
