#!/usr/bin/env python3
"""shardtrain's layering rule, checked: each layer includes only its own headers and those of the
layers listed before it in LAYERS (runtime first), except the few deliberate EXCEPTIONS below.
docs/architecture.md describes the layers and cites this table; it is written here once.

A file's layer is its folder: src/<layer>/... and include/shardtrain/<layer>/... (src/main.cpp is
the app layer). Every include of a shardtrain header is checked, whether written
"shardtrain/<layer>/x.h" or relative to the file ("../backend/cuda/cuda_check.h"); system and
third-party headers are not. Also refused: a header directly in include/shardtrain/ (outside every
layer), a folder of src/ or include/shardtrain/ that is not a layer, a shardtrain include that
names no existing file.

Usage: tests/check_layers.py [ROOT]   (ROOT: the repository, default this script's parent's parent)
Exit 0 and one summary line when the rule holds; else one line per violation, "file:line: ...", exit 1.
Standard library only (make test runs it; no dependency).
"""
import os
import re
import sys

# The layers, lowest first. A layer may include its own headers and those of every layer above it
# in this list.
LAYERS = ["runtime", "backend", "shard", "model", "data", "io", "parallel", "train", "app"]

# Deliberate exceptions: (including file, included file), both repository paths. Each says why.
EXCEPTIONS = {
    # Comm's element types include bf16, the backend's 16-bit float (a plain struct, no backend code).
    ("include/shardtrain/runtime/runtime_inl.h", "include/shardtrain/backend/bf16.h"),
    # The device-buffer Comms (NCCL, host-staged) run on a CudaContext's stream and live in the CUDA
    # plugin with the backend's .cu files, whose error checks and plugin ABI they share.
    ("src/runtime/cuda_comm.cu", "include/shardtrain/backend/cuda.h"),
    ("src/runtime/cuda_comm.cu", "src/backend/cuda/cuda_check.h"),
    ("src/runtime/cuda_comm.cu", "src/backend/cuda/plugin_abi.h"),
}

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
SOURCE_EXT = (".h", ".cpp", ".cu", ".cuh")


def layer_of(rel):
    """The layer of a repository path, or None when it is in no layer's folder."""
    parts = rel.split("/")
    if rel == "src/main.cpp":
        return "app"
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    if parts[:2] == ["include", "shardtrain"] and len(parts) > 3:
        return parts[2]
    return None


def resolve(root, rel, target):
    """The repository path an include names, or None when it is not a shardtrain file."""
    if target.startswith("shardtrain/"):
        return "include/" + target
    cand = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    if os.path.isfile(os.path.join(root, cand)):
        return cand
    return None


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    errors, checked = [], 0
    for top in ("src", "include/shardtrain"):
        base = os.path.join(root, top)
        for entry in sorted(os.listdir(base)):
            path = os.path.join(base, entry)
            if os.path.isdir(path) and entry not in LAYERS:
                errors.append(f"{top}/{entry}/: not a layer (tests/check_layers.py LAYERS: {', '.join(LAYERS)})")
            elif os.path.isfile(path) and top == "include/shardtrain":
                errors.append(f"{top}/{entry}: a header outside every layer folder (include/shardtrain/<layer>/)")
    for top in ("src", "include"):
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if not name.endswith(SOURCE_EXT):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                layer = layer_of(rel)
                if layer not in LAYERS:
                    continue
                with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        dep = resolve(root, rel, m.group(1))
                        if dep is None:
                            continue
                        checked += 1
                        if not os.path.isfile(os.path.join(root, dep)):
                            errors.append(f"{rel}:{lineno}: includes {m.group(1)}, which does not exist")
                            continue
                        dep_layer = layer_of(dep)
                        if dep_layer not in LAYERS:
                            errors.append(f"{rel}:{lineno}: includes {dep}, which is in no layer")
                        elif LAYERS.index(dep_layer) > LAYERS.index(layer) and (rel, dep) not in EXCEPTIONS:
                            errors.append(f"{rel}:{lineno}: the {layer} layer includes {dep} of the {dep_layer} "
                                          f"layer, above it (order: {' < '.join(LAYERS)}; exceptions: "
                                          f"tests/check_layers.py EXCEPTIONS)")
    for e in errors:
        print(e)
    if errors:
        print(f"check_layers: {len(errors)} violation(s) of the layer order")
        return 1
    print(f"check_layers: {checked} shardtrain includes in {' < '.join(LAYERS)} order, "
          f"{len(EXCEPTIONS)} deliberate exceptions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
