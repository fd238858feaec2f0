"""The metadata checksums of a shardtrain checkpoint, computed with h5py alone from the documented
layout (docs/checkpoint-format.md, "Integrity"): an implementation independent of shardtrain's C++.

  ckpt_meta.py verify FILE   exit 0 iff every attribute and table matches its stored CRC32
  ckpt_meta.py reseal FILE   recompute and store the checksums (after a deliberate edit with h5py)
"""
import json
import sys
import zlib

import h5py
import numpy as np

# One param_table row, packed field by field, little-endian: 128 + 8 + 8 + 4 + 32 = 180 bytes.
PACKED_ROW = np.dtype([("name", "S128"), ("offset", "<i8"), ("numel", "<i8"), ("ndim", "<i4"), ("shape", "<i8", (4,))])
TABLE, CHECK = "metadata_crc32", "metadata_crc32_check"
# The checksummed attributes (format version 3; version 2 files lack spike_stats; version 4 adds
# tensor_parallel and the units' TP record, version 5 mesh, version 6 pipeline and the units' stage).
# Others a file may carry are neither used nor covered.
ROOT_ATTRS = ["format", "format_version", "step", "tokens_seen", "world_size", "model_config", "train_config",
              "data_position", "rng_state", "program_version", "data", "spike_stats", "tensor_parallel", "mesh",
              "pipeline"]
UNIT_ATTRS = ["index", "numel", "shard_size", "padded_numel", "local_numel", "local_shard_size", "stage"]
UNIT_TP_TABLES = ["tp_table", "tp_shard_table"]  # versions 4 and 5 with TP: int64 tables


def canonical(value):
    """An attribute's canonical bytes: a string's UTF-8 bytes, an integer's 8 bytes little-endian."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (int, np.integer)):
        return int(value).to_bytes(8, "little", signed=True)
    raise TypeError(f"unexpected attribute value {value!r}")


def metadata_items(f):
    """Every checksummed item of an open checkpoint: key -> canonical bytes."""
    items = {"@" + k: canonical(f.attrs[k]) for k in ROOT_ATTRS if k in f.attrs}
    for name, unit in f["units"].items():
        items.update({f"units/{name}@{k}": canonical(unit.attrs[k]) for k in UNIT_ATTRS if k in unit.attrs})
        items[f"units/{name}/shard_table"] = unit["shard_table"][:].astype("<i8").tobytes()
        items[f"units/{name}/shard_crc32"] = unit["shard_crc32"][:].astype("<u4").tobytes()
        items[f"units/{name}/param_table"] = unit["param_table"][:].astype(PACKED_ROW).tobytes()
        for t in UNIT_TP_TABLES:
            if t in unit:
                items[f"units/{name}/{t}"] = unit[t][:].astype("<i8").tobytes()
    if "tokenizer" in f:  # optional group: its `info` attribute (the files carry CRC32s inside it)
        items["tokenizer@info"] = canonical(f["tokenizer"].attrs["info"])
    return items


def problems(path):
    """The items whose bytes do not match the stored table (empty when the file is intact)."""
    with h5py.File(path, "r") as f:
        table = f.attrs[TABLE]
        if zlib.crc32(table.encode("utf-8")) != int(f.attrs[CHECK]):
            return [TABLE]
        stored, items = json.loads(table), metadata_items(f)
        return sorted(set(stored) ^ set(items)) + [k for k in sorted(items) if k in stored and zlib.crc32(items[k]) != stored[k]]


def reseal(path):
    """Rewrites the checksum table of `path` to match its current contents."""
    with h5py.File(path, "r+") as f:
        items = metadata_items(f)
        table = json.dumps({k: zlib.crc32(items[k]) for k in sorted(items)}, separators=(",", ":"))
        # Variable-length UTF-8 strings and int64, as shardtrain writes them.
        f.attrs.create(TABLE, table, dtype=h5py.string_dtype("utf-8"))
        f.attrs.create(CHECK, zlib.crc32(table.encode("utf-8")), dtype="<i8")


if __name__ == "__main__":
    cmd, path = sys.argv[1], sys.argv[2]
    if cmd == "verify":
        bad = problems(path)
        print(f"{path}: " + (f"checksum mismatch: {', '.join(bad)}" if bad else "metadata checksums verified"))
        sys.exit(1 if bad else 0)
    elif cmd == "reseal":
        reseal(path)
    else:
        sys.exit(__doc__)
