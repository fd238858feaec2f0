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

    def test_plan_matches_shardtrain(self):
        # The shard elements per rank that `shardtrain --mode plan` prints, when a build exists.
        import re
        import subprocess
        exe = next((os.path.join(ROOT, b, "shardtrain") for b in ("build-cpu", "build")
                    if os.path.exists(os.path.join(ROOT, b, "shardtrain"))), None)
        if exe is None:
            self.skipTest("no build-cpu/shardtrain or build/shardtrain")
        for model, world in (("llama-1b", 8), ("llama-8b", 64), (CONFIG, 2), (CONFIG, 4)):
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
