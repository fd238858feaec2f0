"""shardtrain token files (docs/data-format.md) in Python: one reader and one streaming writer that
scripts/tokenize_hf.py, the tests and other scripts share.

    import shardtrain_tokens as st
    t = st.read_token_file("corpus.tok")
    t["train"], t["val"]          # numpy memmaps (u16 or u32), nothing copied
    t["metadata"]["tokenizer"]    # version 2: the tokenizer's description
    t["files"]["tokenizer.json"]  # version 2: the tokenizer's files, as bytes
    t["starts"], t["roles"]       # version 3: example starts (u64) and role classes (u8), memmaps
    t["metadata"]["examples"]["end_of_turn_ids"]  # version 3: the ids of the end-of-turn tokens

    w = st.TokenFileWriter("out.tok", vocab_size=50257, bos_id=None, eos_id=50256, kind="hf-tokenizers")
    w.append(ids)                 # any number of times; streamed to a temporary file
    w.finish(val_fraction=0.1, metadata={...}, files={"tokenizer.json": b"..."})  # atomic rename

    w = st.TokenFileWriter("chat.tok", ..., examples=True)   # version 3
    w.append(ids, roles)          # one whole example per call: its ids and role classes

Both raise TokenFileError (a ValueError) with the file named.
"""

import json
import math
import os
import struct
import tempfile
import zlib

import numpy as np

MAGIC = b"STTOKv1\0"
HEADER_BYTES = 64
NO_ID = 0xFFFFFFFF  # header bos_id / eos_id: "none"
KINDS = ("byte-level", "sentencepiece", "hf-tokenizers")
VERSIONS = (1, 2, 3)
# Version 3's role classes (the u8 values of the "roles" array).
ROLE_CONTEXT, ROLE_ASSISTANT, ROLE_END_OF_TURN = 0, 1, 2
ROLE_CLASSES = ("context", "assistant", "end_of_turn")
# magic, version, vocab_size, bos_id, eos_id, bytes per token, J (v1: reserved), n_train, n_val, kind
_HEADER = struct.Struct("<8sIIIIIIQQ16s")
assert _HEADER.size == HEADER_BYTES


class TokenFileError(ValueError):
    pass


def token_dtype(vocab_size):
    """u16 tokens when every id fits (vocab_size <= 65536), else u32."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def read_header(path):
    """The 64-byte header of `path` as a dict (bos_id / eos_id None for 0xFFFFFFFF)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise TokenFileError(f"cannot read token file '{path}': {e.strerror}") from None
    if len(raw) < HEADER_BYTES:
        raise TokenFileError(f"token file '{path}': {len(raw)} bytes, shorter than the 64-byte header")
    magic, version, vocab, bos, eos, b, j, n_train, n_val, kind = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise TokenFileError(f"token file '{path}': bad magic {magic!r} (expected {MAGIC!r})")
    if version not in VERSIONS:
        raise TokenFileError(f"token file '{path}': unknown format version {version}")
    if b not in (2, 4):
        raise TokenFileError(f"token file '{path}': bytes per token {b}, expected 2 or 4")
    return {
        "version": version, "vocab_size": vocab,
        "bos_id": None if bos == NO_ID else bos, "eos_id": None if eos == NO_ID else eos,
        "token_bytes": b, "json_bytes": j if version >= 2 else 0,
        "n_train": n_train, "n_val": n_val,
        "kind": kind.rstrip(b"\0").decode("ascii", "replace"),
    }


def read_token_file(path, check_tokens=True):
    """Reads and checks token file `path`: the header fields, "train" and "val" (numpy memmaps of
    the file), and for versions 2 and 3 "metadata" (the JSON, a dict) and "files" (name -> bytes,
    CRC32 checked); for version 3 "starts" (u64, one per example) and "roles" (u8, one per token),
    memmaps whose CRC32 and rules (docs/data-format.md) are checked. Version 1 files have metadata
    None and files {}; versions 1 and 2 have starts and roles None. check_tokens: refuse ids >=
    vocab_size (reads every token once)."""
    h = read_header(path)
    b, n = h["token_bytes"], h["n_train"] + h["n_val"]
    size = os.path.getsize(path)
    end_tokens = HEADER_BYTES + b * n
    if h["version"] == 1 and size != end_tokens:
        raise TokenFileError(f"token file '{path}': {size} bytes, the header says {end_tokens} (version 1)")
    if size < end_tokens + h["json_bytes"]:
        raise TokenFileError(f"token file '{path}': {size} bytes, shorter than its tokens and metadata "
                             f"({end_tokens + h['json_bytes']})")
    dt = np.dtype("<u2") if b == 2 else np.dtype("<u4")
    if n > 0:
        tok = np.memmap(path, dtype=dt, mode="r", offset=HEADER_BYTES, shape=(n,))
    else:
        tok = np.zeros(0, dtype=dt)
    h["train"], h["val"] = tok[: h["n_train"]], tok[h["n_train"]:]
    if check_tokens and n > 0:
        top = int(tok.max())
        if top >= h["vocab_size"]:
            raise TokenFileError(f"token file '{path}': token {top} >= vocab_size {h['vocab_size']}")
    h["metadata"], h["files"], h["starts"], h["roles"] = None, {}, None, None
    if h["version"] == 1:
        return h
    try:
        return _read_metadata(path, h, size, end_tokens)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        if isinstance(e, TokenFileError):
            raise
        raise TokenFileError(f"token file '{path}': metadata field missing or of the wrong type "
                             f"({type(e).__name__}: {e})") from None


def _uint(x, what):
    """A JSON non-negative integer (not a bool, not a float), else TypeError naming it."""
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise TypeError(f"{what} is {x!r}, not a non-negative integer")
    return x


def _read_metadata(path, h, size, end_tokens):
    with open(path, "rb") as f:
        f.seek(end_tokens)
        raw = f.read(h["json_bytes"])
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenFileError(f"token file '{path}': metadata is not UTF-8 JSON: {e}") from None
        tk = meta.get("tokenizer", {})
        for key in ("kind", "vocab_size", "bos_id", "eos_id"):
            if key in tk and tk[key] != h[key]:
                raise TokenFileError(f"token file '{path}': metadata tokenizer.{key} {tk[key]!r} "
                                     f"disagrees with the header's {h[key]!r}")
        area = end_tokens + h["json_bytes"]
        entries = []  # (name, offset, bytes, crc32 or None)
        for name, fm in tk.get("files", {}).items():
            crc = fm.get("crc32")
            entries.append((f"tokenizer file '{name}'", _uint(fm["offset"], f"{name}.offset"),
                            _uint(fm["bytes"], f"{name}.bytes"), None if crc is None else _uint(crc, f"{name}.crc32")))
        ex = meta.get("examples") if h["version"] == 3 else None
        if h["version"] == 3:
            if not isinstance(ex, dict):
                raise TokenFileError(f"token file '{path}': version 3 without an 'examples' object in its metadata")
            for key in ("starts", "roles"):
                e = ex.get(key)
                if not isinstance(e, dict):
                    raise TokenFileError(f"token file '{path}': metadata examples.{key} is missing")
                entries.append((f"examples.{key}", _uint(e["offset"], f"examples.{key}.offset"),
                                _uint(e["bytes"], f"examples.{key}.bytes"), _uint(e["crc32"], f"examples.{key}.crc32")))
        total = 0
        for what, off, nb, crc in sorted(entries, key=lambda x: x[1]):
            if off != total or nb < 0 or area + off + nb > size:
                raise TokenFileError(f"token file '{path}': {what} (offset {off}, {nb} bytes) lies outside the file "
                                     f"or not right after the previous entry (at {total})")
            f.seek(area + off)
            data = f.read(nb)
            if crc is not None and zlib.crc32(data) != int(crc):
                raise TokenFileError(f"token file '{path}': {what} fails its CRC32")
            if what.startswith("tokenizer file"):
                h["files"][what.split("'")[1]] = data
            total += nb
        if size != area + total:
            raise TokenFileError(f"token file '{path}': {size} bytes, the header and metadata say {area + total}")
    if "generation_config.json" in h["files"]:
        check_generation_config(h["files"]["generation_config.json"], h["vocab_size"],
                                f"token file '{path}': tokenizer file 'generation_config.json'")
    h["metadata"] = meta
    if ex is not None:
        h["starts"], h["roles"] = _check_examples(path, h, ex, area)
    return h


def _check_examples(path, h, ex, area):
    """Version 3's arrays as memmaps, after the rules of docs/data-format.md."""
    n = h["n_train"] + h["n_val"]
    count, n_tr, n_va = (_uint(ex.get(k), f"examples.{k}") for k in ("count", "train", "val"))
    if n_tr + n_va != count or count > n:
        raise TokenFileError(f"token file '{path}': examples.count/train/val {count}/{n_tr}/{n_va} do not add up")
    if int(ex["starts"]["bytes"]) != 8 * count or int(ex["roles"]["bytes"]) != n:
        raise TokenFileError(f"token file '{path}': examples.starts holds {ex['starts']['bytes']} bytes, roles "
                             f"{ex['roles']['bytes']} (expected {8 * count} and {n})")
    starts = np.memmap(path, dtype="<u8", mode="r", offset=area + int(ex["starts"]["offset"]), shape=(count,)) \
        if count else np.zeros(0, dtype="<u8")
    roles = np.memmap(path, dtype="u1", mode="r", offset=area + int(ex["roles"]["offset"]), shape=(n,)) \
        if n else np.zeros(0, dtype="u1")
    if (count == 0) != (n == 0) or (count and (int(starts[0]) != 0 or int(starts[-1]) >= n
                                               or (count > 1 and not bool(np.all(np.diff(starts.astype(np.int64)) > 0))))):
        raise TokenFileError(f"token file '{path}': examples.starts is not 0, then strictly increasing below {n}")
    if n_va == 0 and h["n_val"]:
        raise TokenFileError(f"token file '{path}': {h['n_val']} validation tokens without validation examples")
    if n_va and int(starts[n_tr]) != h["n_train"]:
        raise TokenFileError(f"token file '{path}': the validation split does not start at an example "
                             f"(starts[{n_tr}] = {int(starts[n_tr])}, n_train {h['n_train']})")
    if n and int(roles.max()) >= len(ROLE_CLASSES):
        raise TokenFileError(f"token file '{path}': role class {int(roles.max())} (known: 0-{len(ROLE_CLASSES) - 1})")
    eot = ex.get("end_of_turn_ids")
    if not isinstance(eot, list):
        raise TokenFileError(f"token file '{path}': examples.end_of_turn_ids is {eot!r}, not a list of token ids")
    for x in eot:
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < h["vocab_size"]:
            raise TokenFileError(f"token file '{path}': examples.end_of_turn_ids holds {x!r}, not a token id below "
                                 f"vocab_size {h['vocab_size']}")
    used, step = set(), 1 << 24  # in slices: memory does not grow with the corpus
    for part, off in ((h["train"], 0), (h["val"], h["n_train"])):
        for a in range(0, len(part), step):
            b = min(a + step, len(part))
            used.update(np.unique(part[a:b][np.asarray(roles[off + a: off + b]) == ROLE_END_OF_TURN]).tolist())
    used = sorted(used)
    if eot != used:
        raise TokenFileError(f"token file '{path}': examples.end_of_turn_ids {eot} are not the distinct ids of the "
                             f"end-of-turn tokens (role class {ROLE_END_OF_TURN}), ascending: {used}")
    return starts, roles


def check_generation_config(data, vocab_size, what):
    """A generation_config.json carried beside a tokenizer (as shardtrain's check_carried_file, data.h):
    a JSON object whose bos_token_id / pad_token_id are absent, None or an id, and eos_token_id also a
    non-empty list of ids (integers in [0, vocab_size)). Raises TokenFileError naming `what`."""
    try:
        g = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenFileError(f"{what}: not UTF-8 JSON: {e}") from None
    if not isinstance(g, dict):
        raise TokenFileError(f"{what}: not a JSON object")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = g.get(key)
        if v is None:
            continue
        if key == "eos_token_id" and isinstance(v, list) and not v:
            raise TokenFileError(f"{what}: key 'eos_token_id' is an empty list")
        for x in v if key == "eos_token_id" and isinstance(v, list) else [v]:
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise TokenFileError(f"{what}: key '{key}' must be a token id (an integer >= 0)"
                                     f"{' or a list of them' if key == 'eos_token_id' else ''}, got {json.dumps(v)}")
            if x >= vocab_size:
                raise TokenFileError(f"{what}: key '{key}' = {json.dumps(v)}: id {x} is outside the vocabulary "
                                     f"(vocab_size {vocab_size})")


class TokenFileWriter:
    """Writes a version 2 token file in constant memory: tokens go to a temporary file next to
    `path` as they arrive; finish() appends the metadata and the tokenizer files, writes the header
    and renames the temporary file to `path` (so `path` is either the old file or the complete new
    one). abort() (or an exception inside a `with` block) removes the temporary file.

    examples=True writes version 3 (docs/data-format.md): each append() is one whole example with
    its role classes (a second temporary file holds the roles; the starts, 8 bytes an example, are
    held in memory), and the validation split is the last floor(count * val_fraction) examples;
    examples.end_of_turn_ids are the distinct ids appended with role class 2."""

    def __init__(self, path, vocab_size, bos_id, eos_id, kind, examples=False):
        if kind not in KINDS:
            raise ValueError(f"tokenizer kind {kind!r}: expected one of {KINDS}")
        if len(kind.encode("ascii")) > 16:
            raise ValueError(f"tokenizer kind {kind!r} is longer than 16 bytes")
        if not 0 < vocab_size < NO_ID:
            raise ValueError(f"vocab_size {vocab_size} out of range")
        for name, v in (("bos_id", bos_id), ("eos_id", eos_id)):
            if v is not None and not 0 <= v < vocab_size:
                raise ValueError(f"{name} {v} is not below vocab_size {vocab_size}")
        self.path, self.vocab_size, self.bos_id, self.eos_id, self.kind = path, vocab_size, bos_id, eos_id, kind
        self.dtype = token_dtype(vocab_size)
        self.n = 0
        self.examples = examples
        self.starts = []
        self.end_of_turn_ids = set()
        self.tmp = self.roles_tmp = None
        d = os.path.dirname(os.path.abspath(path))
        fd, self.tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
        self.f = os.fdopen(fd, "wb")
        self.f.write(b"\0" * HEADER_BYTES)
        if examples:
            fd, self.roles_tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".roles.tmp", dir=d)
            self.rf = os.fdopen(fd, "w+b")

    def append(self, ids, roles=None):
        """Appends token ids (any integer array-like); refuses ids outside [0, vocab_size). Version 3:
        `ids` is one whole example (not empty) and `roles` its role classes, one per id."""
        a = np.asarray(ids)
        if self.examples:
            r = np.asarray(roles, dtype=np.int64) if roles is not None else None
            if r is None or r.shape != a.shape or a.size == 0:
                raise ValueError("version 3: append() takes one non-empty example and one role class per token")
            if int(r.min()) < 0 or int(r.max()) >= len(ROLE_CLASSES):
                raise ValueError(f"role class outside 0-{len(ROLE_CLASSES) - 1}")
        if a.size == 0:
            return
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= self.vocab_size:
            raise TokenFileError(f"token file '{self.path}': token {hi if hi >= self.vocab_size else lo} "
                                 f"outside [0, vocab_size {self.vocab_size})")
        if self.examples:
            self.starts.append(self.n)
            self.rf.write(r.astype(np.uint8).tobytes())
            self.end_of_turn_ids.update(int(x) for x in np.unique(a[r == ROLE_END_OF_TURN]))
        self.f.write(a.astype(self.dtype, copy=False).tobytes())
        self.n += a.size

    def finish(self, val_fraction, metadata=None, files=None, examples=None):
        """Ends the file: the last floor(n * val_fraction) tokens are the validation split (version 3:
        the last floor(count * val_fraction) examples). metadata: extra top-level keys (e.g.
        "documents", "inputs", "written_by") and a "tokenizer" dict whose kind / vocab_size / bos_id /
        eos_id / files are filled in here. files: name -> bytes, in order. examples (version 3): extra
        keys of the "examples" object ("source", "template"). Returns the header as read_header() gives it."""
        if self.examples:
            count = len(self.starts)
            e_val = int(math.floor(count * val_fraction))
            n_train = self.starts[count - e_val] if e_val else self.n
            n_val = self.n - n_train
        else:
            n_val = int(math.floor(self.n * val_fraction))
            n_train = self.n - n_val
        files = dict(files or {})
        meta = {"format": "shardtrain-tokens"}
        meta.update(metadata or {})
        tk = dict(meta.get("tokenizer", {}))
        tk.update({"kind": self.kind, "vocab_size": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id})
        placed, off = {}, 0
        for name, data in files.items():
            placed[name] = {"offset": off, "bytes": len(data), "crc32": zlib.crc32(data)}
            off += len(data)
        tk["files"] = placed
        meta["tokenizer"] = tk
        if self.examples:
            starts = np.asarray(self.starts, dtype="<u8").tobytes()
            self.rf.flush()
            self.rf.seek(0)
            crc, nb = 0, 0
            while True:
                chunk = self.rf.read(4 << 20)
                if not chunk:
                    break
                crc, nb = zlib.crc32(chunk, crc), nb + len(chunk)
            assert nb == self.n
            ex = {"count": count, "train": count - e_val, "val": e_val}
            ex.update(examples or {})
            ex["role_classes"] = list(ROLE_CLASSES)
            ex["end_of_turn_ids"] = sorted(self.end_of_turn_ids)
            ex["starts"] = {"offset": off, "bytes": len(starts), "crc32": zlib.crc32(starts)}
            ex["roles"] = {"offset": off + len(starts), "bytes": nb, "crc32": crc}
            meta["examples"] = ex
        blob = json.dumps(meta, indent=1, ensure_ascii=False).encode("utf-8")
        self.f.write(blob)
        for data in files.values():
            self.f.write(data)
        if self.examples:
            self.f.write(starts)
            self.rf.seek(0)
            while True:
                chunk = self.rf.read(4 << 20)
                if not chunk:
                    break
                self.f.write(chunk)
        version = 3 if self.examples else 2
        header = _HEADER.pack(MAGIC, version, self.vocab_size, NO_ID if self.bos_id is None else self.bos_id,
                              NO_ID if self.eos_id is None else self.eos_id, self.dtype.itemsize, len(blob),
                              n_train, n_val, self.kind.encode("ascii").ljust(16, b"\0"))
        self.f.seek(0)
        self.f.write(header)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.chmod(self.tmp, 0o666 & ~_umask())
        os.replace(self.tmp, self.path)
        self.tmp = None
        self._drop_roles()
        return read_header(self.path)

    def _drop_roles(self):
        if self.roles_tmp is not None:
            _close_and_remove(self.rf, self.roles_tmp)
            self.roles_tmp = None

    def abort(self):
        self._drop_roles()
        if self.tmp is not None:
            _close_and_remove(self.f, self.tmp)
            self.tmp = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.abort()
        return False


def _close_and_remove(f, path):
    f.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m
