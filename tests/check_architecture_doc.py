#!/usr/bin/env python3
"""docs/architecture.md matches the tree: every file of src/ and include/shardtrain/ is named in it
(as a backquoted repository path, e.g. `src/parallel/pipeline.cpp`), and every such path it names
exists. A file added without a line in architecture.md's tables, or one removed or renamed without
updating them, fails here.

Usage: tests/check_architecture_doc.py [ROOT]   (standard library only; make test runs it)
Exit 0 and one summary line when the page and the tree agree; else one line per difference, exit 1.
"""
import os
import re
import sys

DOC = "docs/architecture.md"
TREES = ("src", "include/shardtrain")
SOURCE_EXT = (".h", ".cpp", ".cu", ".cuh")
PATH = re.compile(r"`((?:src|include/shardtrain)/[A-Za-z0-9_./-]+)`")


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    with open(os.path.join(root, DOC), encoding="utf-8") as f:
        text = f.read()
    named = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in PATH.finditer(line):
            named.setdefault(m.group(1).rstrip("/"), lineno)
    files = []
    for top in TREES:
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            files += [os.path.relpath(os.path.join(dirpath, n), root) for n in names if n.endswith(SOURCE_EXT)]
    errors = [f"{DOC}: does not name {p} (add it to the table of its layer)" for p in sorted(files) if p not in named]
    errors += [f"{DOC}:{n}: names {p}, which does not exist" for p, n in sorted(named.items())
               if not os.path.exists(os.path.join(root, p))]
    for e in errors:
        print(e)
    if errors:
        print(f"check_architecture_doc: {len(errors)} difference(s) between {DOC} and the tree")
        return 1
    print(f"check_architecture_doc: {DOC} names all {len(files)} files of {' and '.join(TREES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
