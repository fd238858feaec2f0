#!/usr/bin/env python3
"""h5_equal.py A B: exit 0 iff the HDF5 files A and B hold the same groups, datasets and attributes,
bitwise: every object's path and kind, every dataset's dtype, shape and bytes, every attribute's
name, dtype, shape and bytes (of groups, datasets and the root). Nothing is excluded: shardtrain
writes no time or host into its attributes. HDF5's own object-header timestamps (H5Pset_obj_track_times)
are not attributes and are not visible here, so they do not count. Prints every difference."""
import sys

import h5py
import numpy as np


def as_bytes(v):
    if isinstance(v, (bytes, str)):
        return v.encode() if isinstance(v, str) else v
    a = np.asarray(v)
    if a.dtype.kind == "O":
        return repr(a.tolist()).encode()
    return a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes()


def objects(f):
    out = {"/": f}
    f.visititems(lambda name, obj: out.__setitem__("/" + name, obj))
    return out


def main(a_path, b_path):
    diffs, counts = [], {"datasets": 0, "attributes": 0, "groups": 0}
    with h5py.File(a_path, "r") as a, h5py.File(b_path, "r") as b:
        oa, ob = objects(a), objects(b)
        for p in sorted(set(oa) ^ set(ob)):
            diffs.append(f"{p}: only in {'A' if p in oa else 'B'}")
        for p in sorted(set(oa) & set(ob)):
            x, y = oa[p], ob[p]
            if type(x) is not type(y):
                diffs.append(f"{p}: {type(x).__name__} vs {type(y).__name__}")
                continue
            if isinstance(x, h5py.Dataset):
                counts["datasets"] += 1
                if x.dtype != y.dtype or x.shape != y.shape:
                    diffs.append(f"{p}: dtype/shape {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
                elif as_bytes(x[()]) != as_bytes(y[()]):
                    xa, ya = np.asarray(x[()]), np.asarray(y[()])
                    n = int(np.sum(xa != ya)) if xa.dtype.kind in "fiu" else -1
                    diffs.append(f"{p}: data differs ({n} elements)")
            else:
                counts["groups"] += 1
            ka, kb = set(x.attrs.keys()), set(y.attrs.keys())
            for k in sorted(ka ^ kb):
                diffs.append(f"{p}@{k}: only in {'A' if k in ka else 'B'}")
            for k in sorted(ka & kb):
                counts["attributes"] += 1
                if as_bytes(x.attrs[k]) != as_bytes(y.attrs[k]):
                    diffs.append(f"{p}@{k}: {str(x.attrs[k])[:120]!r} vs {str(y.attrs[k])[:120]!r}")
    for d in diffs:
        print("differs:", d)
    print(f"{'DIFFERENT' if diffs else 'equal'}: {counts['groups']} groups, {counts['datasets']} datasets, "
          f"{counts['attributes']} attributes compared")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
