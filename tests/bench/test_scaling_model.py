#!/usr/bin/env python3
"""Arithmetic checks of scripts/scaling_model.py (stdlib unittest; no MPI, no shardtrain run):
its self-test, and `check` on a hand-made bandwidth file and hand-made --metrics files whose
answer is worked out below by hand. Run: python3 tests/bench/test_scaling_model.py"""
import io
import json
import os
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import scaling_model as sm  # noqa: E402

CONFIG = os.path.join(ROOT, "tests", "bench", "scaling-config.json")
ALPHA, BW = 10e-6, 1e9  # the hand-made machine: t = 10 us + S / (1 GB/s), every collective


def bench_line(world):
    res = []
    for op in ("allgather", "reduce_scatter"):
        for S in (1000, 10 ** 6, 10 ** 8):
            res.append({"op": op, "dtype": "float32", "elem_bytes": 4, "bytes": S, "median_s": ALPHA + S / BW})
    return json.dumps({"tool": "comm_bandwidth", "world": world, "results": res})


class ScalingModelTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        d = self.dir.name
        self.bench = os.path.join(d, "comm.jsonl")
        with open(self.bench, "w") as f:
            f.write(bench_line(2) + "\n" + bench_line(4) + "\n")
        self.m2 = os.path.join(d, "m2.jsonl")
        with open(self.m2, "w") as f:
            for step, c in enumerate([999.0, 999.0, 500.0, 600.0, 700.0], 1):
                f.write(json.dumps({"step": step, "loss": 5.0, "comm_ms": c, "exposed_comm_ms": c,
                                    "compute_ms": 100.0}) + "\n")
            f.write(json.dumps({"step": 5, "val_loss": 5.0}) + "\n")  # evaluation rows are ignored

    def tearDown(self):
        self.dir.cleanup()

    def test_selftest(self):
        sm.selftest()

    def test_predicted_comm_w2_by_hand(self):
        # scaling-config.json at W = 2, fp32: shard sizes embed 132096, block 5637120, norm 512.
        # All-gathers: embed x2 and norm x2 in one call each; each block x2, in MpiComm slabs of
        # 16 MiB / 4 B / 2 = 2097152 elements per rank: 3 calls. 2 + 2 + 4*2*3 = 28 calls.
        # Reduce-scatters: Fsdp slabs of min(5637120, 2^22 / 2) = 2097152: blocks 3 calls each;
        # embed x2, norm x1: 4*3 + 2 + 1 = 15 calls.
        # Bytes (S = count per rank x W x 4): all-gather (2*132096 + 8*5637120 + 2*512) * 8,
        # reduce-scatter (2*132096 + 4*5637120 + 512) * 8.
        ag = (2 * 132096 + 8 * 5637120 + 2 * 512) * 8
        rs = (2 * 132096 + 4 * 5637120 + 512) * 8
        expect = 43 * ALPHA + (ag + rs) / BW
        cfg = sm.load_config(CONFIG)
        got = sm.predict_comm(cfg, 2, sm.Precision("fp32"), sm.load_bench(self.bench))
        self.assertAlmostEqual(got, expect, places=12)
        self.assertEqual(len(sm.cpu_step_calls(cfg, 2, sm.Precision("fp32"))), 43)

    def test_check_table(self):
        class A:
            model = CONFIG
            metrics = [self.m2]
            world = [2]
            bandwidth_json = self.bench
            seq_len = 256
            micro_batch = 1
            accum = 1
            precision = "fp32"
            prefetch = 0  # --overlap off: exposed = comm
            skip = 2
        out = io.StringIO()
        (r,) = sm.check(A, out=out)
        pred = (43 * ALPHA + ((2 * 132096 + 8 * 5637120 + 2 * 512) + (2 * 132096 + 4 * 5637120 + 512)) * 8 / BW) * 1e3
        self.assertAlmostEqual(r["predicted_comm_ms"], pred, places=9)
        self.assertEqual(r["measured_comm_ms"], 600.0)  # mean of steps 3..5
        self.assertAlmostEqual(r["predicted_exposed_ms"], pred, places=9)
        self.assertIn("%+.1f%%" % (100 * (pred - 600.0) / 600.0), out.getvalue())
        # With prefetch 1 some of it hides behind the 100 ms of compute, never more than that.
        A.prefetch = 1
        (r1,) = sm.check(A, out=io.StringIO())
        self.assertLess(r1["predicted_exposed_ms"], pred)
        self.assertGreater(r1["predicted_exposed_ms"], pred - 100.0 - 1e-9)

    def test_accumulation_multiplies(self):
        cfg = sm.load_config(CONFIG)
        b = sm.load_bench(self.bench)
        one = sm.predict_comm(cfg, 4, sm.Precision("fp32"), b)
        self.assertAlmostEqual(sm.predict_comm(cfg, 4, sm.Precision("fp32"), b, micro_batches=3), 3 * one, places=12)

    def test_llama_70b(self):
        cfg = sm.load_config("llama-70b")
        self.assertEqual(cfg.num_params(), 70553706496)  # meta-llama/Llama-3.1-70B, as transformers counts it
        self.assertEqual(sum(n for _, n in sm.units(cfg)), cfg.num_params())
        for tp in (1, 2, 4, 8):
            sm.check_tp(cfg, tp)  # divides 64 heads, 8 KV heads, 28672
        with self.assertRaises(ValueError):
            sm.check_tp(cfg, 16)  # 8 KV heads

    def test_tp_bytes_by_hand(self):
        # scaling-config.json (C 1024, L 4, V 258), micro-batch 2 x 256, tp 2, bf16 activations:
        # F = 2 * 256 * 1024 * 2 = 1,048,576 bytes; each all-gather / reduce-scatter (tp-1)/tp F = 524,288.
        cfg = sm.load_config(CONFIG)
        F = 2 * 256 * 1024 * 2
        b = sm.tp_bytes_per_microbatch(cfg, 2, 256, 2, 2)
        self.assertEqual(b["F"], F)
        self.assertEqual(b["per_layer"], 10 * 524288)  # 10 (tp-1)/tp F
        # Per layer 2 + 4 all-gathers, 2 + 2 reduce-scatters; embedding 1 RS + 1 AG; head 1 AG + 1 RS.
        self.assertEqual(b["calls"], {"all_gather": 4 * 6 + 2, "reduce_scatter": 4 * 4 + 2,
                                      "all_reduce": 2})  # 512 tokens: one chunk (default 2^24 / 258 = 65,027)
        self.assertEqual(sm.tp_bytes_per_microbatch(cfg, 2, 256, 2, 2, loss_chunk=256)["calls"]["all_reduce"], 4)
        self.assertEqual(b["all_gather"], 26 * 524288)
        self.assertEqual(b["reduce_scatter"], 18 * 524288)
        self.assertEqual(b["all_reduce"], 3 * 512 * 4 * 2 * 1 / 2)  # 3 B T floats, 2 (tp-1)/tp
        # Full recompute: + 2 all-gathers + 1 reduce-scatter per layer: 13 (tp-1)/tp F.
        f = sm.tp_bytes_per_microbatch(cfg, 2, 256, 2, 2, "full")
        self.assertEqual(f["per_layer"], 13 * 524288)
        self.assertEqual(f["all_gather"] + f["reduce_scatter"], (4 * 13 + 4) * 524288)
        # tp 4, fp32: (tp-1)/tp = 3/4 of F = 2 * 256 * 1024 * 4.
        b4 = sm.tp_bytes_per_microbatch(cfg, 2, 256, 4, 4)
        self.assertEqual(b4["all_gather"] + b4["reduce_scatter"], (4 * 10 + 4) * 0.75 * 2 * 256 * 1024 * 4)
        # tp 1: no TP collective at all.
        b1 = sm.tp_bytes_per_microbatch(cfg, 2, 256, 1, 2, "full")
        self.assertEqual((b1["all_gather"], b1["reduce_scatter"], b1["all_reduce"]), (0, 0, 0))
        self.assertEqual(b1["calls"], {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0})

    def test_fsdp_bytes_with_tp(self):
        # W 64, tp 8: each TP rank's slice sharded over 8 dp_shard ranks: (8-1)/8 x padded slice x e.
        cfg = sm.load_config("llama-8b")
        pr = sm.Precision("bf16")
        ag, rs = sm.bytes_per_step(cfg, 64, pr, tp=8)
        us = sm.units(cfg, 8)
        self.assertEqual(us[0][1], 128256 // 8 * 4096)
        self.assertEqual(us[1][1], 2 * 4096 + 4096 * 512 + 2 * 4096 * 128 + 512 * 4096 + 3 * 4096 * 1792)
        exp_ag = sum(k * 7 / 8 * sm.shard_size(n, 8) * 8 * 2 for k, (_, n) in zip(sm.collective_counts(cfg)[0], us))
        self.assertAlmostEqual(ag, exp_ag, delta=1e-3)
        self.assertEqual(sm.bytes_per_step(cfg, 64, pr, tp=1), sm.bytes_per_step(cfg, 64, pr))

    def test_tp_time_by_hand(self):
        # llama-8b, 16,384 tokens per GPU, tp 2: the group's micro-batch is 16 x 2048, F = 16*2048*4096*2.
        # 194 all-gathers + 130 reduce-scatters, each alpha + F/2 / 450 GB/s; 128 loss chunks of 256:
        # 256 all-reduces, each 2 alpha + 2 * 1/2 * S / B, S summing to 3 * 32768 * 4.
        cfg = sm.load_config("llama-8b")
        fab = sm.FABRICS["nvlink+ndr"]
        F = 16 * 2048 * 4096 * 2
        a, B = fab.a_intra, fab.B_intra
        expect = 324 * (a + F / 2 / B) + 256 * 2 * a + 3 * 32768 * 4 / B
        r = sm.run_point(cfg, fab, 64, "fsdp", 1, sm.Precision("bf16-noslab"), sm.MFU_MEASURED, tp=2)
        self.assertAlmostEqual(r["tp"], expect, places=9)
        # The TP time is in 'compute' (it blocks); 'exposed' is FSDP's.
        r1 = sm.run_point(cfg, fab, 64, "fsdp", 1, sm.Precision("bf16-noslab"), sm.MFU_MEASURED)
        self.assertAlmostEqual(r["compute"] - r1["compute"], expect, places=9)
        self.assertEqual(r1["tp"], 0.0)

    def test_predict_tp_comm_by_hand(self):
        # scaling-config.json, micro-batch 1 x 256, tp 2, fp32: F = 256 * 1024 * 4 = 1 MiB total per
        # call (131,072 elements per rank: one MpiComm call). 26 all-gathers + 18 reduce-scatters of
        # S = F; 2 all-reduces of 1 KiB and 2 KiB, timed as reduce-scatter + all-gather (the hand-made
        # file has no all-reduce): 4 more calls. The hand-made machine: t = alpha + S / BW.
        cfg = sm.load_config(CONFIG)
        F = 256 * 1024 * 4
        expect = 48 * ALPHA + (44 * F + 2 * (1024 + 2048)) / BW
        got = sm.predict_tp_comm(cfg, 1, 256, 2, 4, sm.load_bench(self.bench))
        self.assertAlmostEqual(got, expect, places=12)
        self.assertAlmostEqual(sm.predict_tp_comm(cfg, 1, 256, 2, 4, sm.load_bench(self.bench), micro_batches=3),
                               3 * expect, places=12)
        full = 48 * ALPHA + 4 * 3 * ALPHA + (44 * F + 4 * 3 * F + 2 * (1024 + 2048)) / BW
        self.assertAlmostEqual(sm.predict_tp_comm(cfg, 1, 256, 2, 4, sm.load_bench(self.bench), recompute="full"),
                               full, places=12)

    def test_plan_matches_shardtrain(self):
        # The shard elements per rank that `shardtrain --mode plan` prints, when a build exists.
        import re
        import subprocess
        exe = next((os.path.join(ROOT, b, "shardtrain") for b in ("build-cpu", "build")
                    if os.path.exists(os.path.join(ROOT, b, "shardtrain"))), None)
        if exe is None:
            self.skipTest("no build-cpu/shardtrain or build/shardtrain")
        for model, world in (("llama-1b", 8), ("llama-8b", 64), ("llama-70b", 64), (CONFIG, 2), (CONFIG, 4)):
            out = subprocess.run([exe, "--mode", "plan", "--model", model, "--world-size", str(world),
                                  "--micro-batch", "1", "--seq-len", "256"], capture_output=True, text=True,
                                 timeout=120).stdout
            m = re.search(r"4 B x ([0-9,]+) shard elements", out)
            self.assertIsNotNone(m, out)
            cfg = sm.load_config(model)
            self.assertEqual(int(m.group(1).replace(",", "")),
                             sum(sm.shard_size(n, world) for _, n in sm.units(cfg)), model)
            slab = re.search(r"reduce-scatter slab buffers \(4 B x ([0-9,]+) x", out)
            max_s = max(sm.shard_size(n, world) for _, n in sm.units(cfg))
            self.assertEqual(int(slab.group(1).replace(",", "")), sm.rs_calls(max_s, max_s, world, sm.Precision("fp32"))[0])


if __name__ == "__main__":
    unittest.main(verbosity=2)
