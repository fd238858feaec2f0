"""The reference for tests/unit/test_fp8.cpp Fp8.DISABLED_EncodeAndScaleEqualTorch (run by
tests/e2e/test_fp8.sh): torch's own float8 conversions of a set of float32 values, torchao's
tensorwise scale formula, and torchao's tensorwise cast of a few tensors, all computed with torch
(torchao is not needed: its three lines are written out below, from torchao/float8/float8_utils.py
amax_to_scale / to_fp8_saturated and float8_scaling_utils hp_tensor_and_scale_to_float8).

Usage: fp8_torch_ref.py OUT    writes into the folder OUT (the file layout is in test_fp8.cpp):
  conv_x.u32, conv_codes.u8     float32 values: edge cases (zeros, the float and fp8 extremes, inf,
                                NaN of both signs, every fp8 value, every midpoint of adjacent fp8
                                values and the floats either side of it, for both formats), 2^20
                                random bit patterns, and 2^20 log-uniform values over 2^-24 .. 2^18
                                (fp8 subnormals, near and beyond both maxima); for each, torch's byte of
                                clamp(x, -448, 448).to(float8_e4m3fn), x.to(float8_e4m3fn),
                                clamp(x, -57344, 57344).to(float8_e5m2), x.to(float8_e5m2).
                                torch's plain .to() is not the saturating cast torchao uses; the C++
                                side compares the saturating encoding with the clamped cast.
  scale_amax.f32, scale.f32     amax values and float32(fp8_max / clamp(float64(amax), min=1e-12))
  quant_len.i64, quant_x.f32,   tensors of amax 0, 1e-3, 1, 1e3, 1e-8, 3e4 and torchao's cast of each:
  quant.u8                      amax = max|x|, scale as above, (x * scale).clamp(-max, max).to(fp8)
Prints one 'ok' line.
"""
import os
import sys

import numpy as np
import torch

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4: 448.0, E5: 57344.0}


def fp8_values(dtype):
    """Every non-negative finite value of the format, increasing."""
    v = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    v = v[torch.isfinite(v) & (v >= 0)]
    return torch.unique(v)  # sorted; +0 once


def edge_cases():
    f32 = np.finfo(np.float32)
    xs = [0.0, -0.0, float(f32.tiny), float(f32.smallest_subnormal), float(f32.max), float("inf"),
          448.0, 464.0, 480.0, 57344.0, 61440.0, 65536.0, 1e-30, 1e30]
    for dtype in (E4, E5):
        v = fp8_values(dtype).double()
        ulp = v[-1] - v[-2]
        v = torch.cat([v, v[-1:] + ulp])  # the value past max, for the overflow midpoint
        mids = ((v[1:] + v[:-1]) / 2).float()
        xs += v.float().tolist() + mids.tolist()
        xs += np.nextafter(mids.numpy(), np.float32(0)).tolist() + np.nextafter(mids.numpy(), np.float32(np.inf)).tolist()
    xs = np.array(xs, dtype=np.float32)
    xs = np.concatenate([xs, -xs]).view(np.uint32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF], dtype=np.uint32)
    return np.concatenate([xs, nans])


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(57)
    random_bits = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    logu = (np.exp2(rng.uniform(-24, 18, size=1 << 20)) * rng.choice([-1, 1], size=1 << 20)).astype(np.float32)
    bits = np.concatenate([edge_cases(), random_bits, logu.view(np.uint32)])
    x = torch.from_numpy(bits.view(np.float32).copy())
    cols = [torch.clamp(x, -MAX[E4], MAX[E4]).to(E4), x.to(E4), torch.clamp(x, -MAX[E5], MAX[E5]).to(E5), x.to(E5)]
    codes = torch.stack([c.view(torch.uint8) for c in cols], dim=1).numpy()
    bits.tofile(f"{out}/conv_x.u32")
    np.ascontiguousarray(codes).tofile(f"{out}/conv_codes.u8")

    def scale_of(amax, dtype):  # torchao amax_to_scale (EPS = 1e-12, no power-of-2 rounding)
        return (MAX[dtype] / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)

    amax = torch.tensor([0.0, 1e-13, 1e-12, 2e-12, 1e-3, 0.1, 1.0, 3.0, 7.5, 1e3, 448.0, 1e20, 3e38, float("inf"),
                         float("nan")] + np.exp2(rng.uniform(-40, 120, size=2000)).tolist(), dtype=torch.float32)
    amax.numpy().tofile(f"{out}/scale_amax.f32")
    torch.stack([scale_of(amax, E4), scale_of(amax, E5)], dim=1).numpy().tofile(f"{out}/scale.f32")

    tensors = []
    for a in (0.0, 1e-3, 1.0, 1e3, 1e-8, 3e4):
        t = torch.from_numpy((np.exp2(rng.uniform(-20, 0, size=4096)) * rng.choice([-1, 1], size=4096) * a).astype(np.float32))
        tensors.append(t)
    qs = []
    for t in tensors:
        row = []
        for dtype in (E4, E5):
            s = scale_of(t.abs().max(), dtype)  # torchao tensor_to_amax, amax_to_scale
            row.append((t.to(torch.float32) * s).clamp(-MAX[dtype], MAX[dtype]).to(dtype).view(torch.uint8))
        qs.append(torch.stack(row, dim=1))
    np.array([len(t) for t in tensors], dtype=np.int64).tofile(f"{out}/quant_len.i64")
    torch.cat(tensors).numpy().tofile(f"{out}/quant_x.f32")
    torch.cat(qs).numpy().tofile(f"{out}/quant.u8")
    print(f"ok: torch {torch.__version__}: {len(bits)} values, {len(amax)} amax values, {len(tensors)} tensors written to {out}")


if __name__ == "__main__":
    main()
