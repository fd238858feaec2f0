"""pp_ckpt_compare.py A B TOL: rebuilds every tensor of checkpoints A and B with h5py alone (the
recipe of docs/checkpoint-format.md, "Rebuilding every tensor with h5py", each saved slice checked
against its CRC32), for `params`, `adam_m` and `adam_v`, and compares them element for element:
exit 0 iff both hold the same parameters and, in every tensor, max |a - b| <= TOL * max |b| (a
difference relative to the tensor's scale; TOL 0: bitwise). Prints the largest such difference per
tensor kind, and the number of elements that differ at all. Knows nothing about how either file was
laid out (stages, shard groups, TP)."""
import sys
import zlib

import h5py
import numpy as np


def tensors(path, kind):
    out = {}
    with h5py.File(path, "r") as f:
        W = int(f.attrs["world_size"])
        col = ["params", "adam_m", "adam_v"].index(kind)
        for unit in f["units"].values():
            flat, S = unit[kind][:], int(unit.attrs["shard_size"])
            assert flat.shape[0] == S * W
            for r in range(W):
                assert zlib.crc32(flat[r * S:(r + 1) * S].astype("<f4").tobytes()) == unit["shard_crc32"][r, col], (path, unit.name, r)
            assert not flat[int(unit.attrs["numel"]):].any(), "padding is not zero"
            for row in unit["param_table"][:]:
                shape = tuple(row["shape"][: row["ndim"]])
                out[row["name"].decode()] = flat[row["offset"]: row["offset"] + row["numel"]].reshape(shape)
    return out


def main(a, b, tol):
    ok = True
    for kind in ["params", "adam_m", "adam_v"]:
        ta, tb = tensors(a, kind), tensors(b, kind)
        if set(ta) != set(tb):
            print(f"{kind}: tensors differ: {sorted(set(ta) ^ set(tb))}")
            ok = False
            continue
        worst, where, n, differ = 0.0, "", 0, 0
        for name in sorted(ta):
            x, y = ta[name].astype(np.float64), tb[name].astype(np.float64)
            if x.shape != y.shape:
                print(f"{kind} {name}: shape {x.shape} vs {y.shape}")
                ok = False
                continue
            n += x.size
            differ += int((x != y).sum())
            scale = np.abs(y).max()
            d = float(np.abs(x - y).max() / scale) if scale > 0 else float(np.abs(x - y).max())
            if d > worst:
                worst, where = d, name
        print(f"{kind}: {len(ta)} tensors, {n} elements ({differ} differ), largest difference relative to its "
              f"tensor's scale {worst:.3g}" + (f" ({where})" if where else ""))
        ok = ok and worst <= tol
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
