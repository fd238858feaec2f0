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
        # Per layer 2 + 4 all-gathers, 2 + 2 reduce-scatters; embedding 1 RS + 1 AG; head 1 AG + 1 RS;
        # the loss: 512 tokens in one chunk (default_loss_chunk(Vl), Vl = ceil(258 / 2) = 129:
        # 2^24 // 129 = 130,055), one all-gather of the fp32 row maxima and one all-reduce of 2n fp32.
        self.assertEqual(b["calls"], {"all_gather": 4 * 6 + 2 + 1, "reduce_scatter": 4 * 4 + 2, "all_reduce": 1})
        c2 = sm.tp_bytes_per_microbatch(cfg, 2, 256, 2, 2, loss_chunk=256)["calls"]
        self.assertEqual((c2["all_gather"], c2["all_reduce"]), (26 + 2, 2))
        self.assertEqual(b["all_gather"], 26 * 524288 + 1 * 512 * 4)  # + (tp-1) n 4: the maxima
        self.assertEqual(b["reduce_scatter"], 18 * 524288)
        self.assertEqual(b["all_reduce"], 2 * 512 * 4 * 2 * 1 / 2)  # 2 B T floats, 2 (tp-1)/tp
        # Full recompute: + 2 all-gathers + 1 reduce-scatter per layer: 13 (tp-1)/tp F.
        f = sm.tp_bytes_per_microbatch(cfg, 2, 256, 2, 2, "full")
        self.assertEqual(f["per_layer"], 13 * 524288)
        self.assertEqual(f["all_gather"] + f["reduce_scatter"], (4 * 13 + 4) * 524288 + 512 * 4)
        # tp 4, fp32: (tp-1)/tp = 3/4 of F = 2 * 256 * 1024 * 4; the maxima 3 x 512 x 4.
        b4 = sm.tp_bytes_per_microbatch(cfg, 2, 256, 4, 4)
        self.assertEqual(b4["all_gather"] + b4["reduce_scatter"],
                         (4 * 10 + 4) * 0.75 * 2 * 256 * 1024 * 4 + 3 * 512 * 4)
        self.assertEqual(b4["all_reduce"], 2 * 3 / 4 * 2 * 512 * 4)
        # tp 1: no TP collective at all.
        b1 = sm.tp_bytes_per_microbatch(cfg, 2, 256, 1, 2, "full")
        self.assertEqual((b1["all_gather"], b1["reduce_scatter"], b1["all_reduce"]), (0, 0, 0))
        self.assertEqual(b1["calls"], {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0})

    def test_tp_doc_example(self):
        # docs/scaling.md's example: scaling-config.json, fp32, micro-batch 1 x 256, tp 2: F = 1 MiB;
        # 27 all-gathers (26 (tp-1)/tp F + the maxima, (tp-1) x 256 x 4), 18 reduce-scatters, 1 all-reduce
        # (2 x 1/2 x 2 x 256 x 4); per step + the norms: 9 all-reduces of 1,024 fp32 (2 x 1/2 x 4,096).
        cfg = sm.load_config(CONFIG)
        b = sm.tp_bytes_per_microbatch(cfg, 1, 256, 2, 4)
        self.assertEqual(b["calls"], {"all_gather": 27, "reduce_scatter": 18, "all_reduce": 1})
        self.assertEqual((b["all_gather"], b["reduce_scatter"], b["all_reduce"]), (13632512, 9437184, 2048))
        self.assertEqual(sm.tp_norm_allreduce(cfg, 2), (9, 36864))
        self.assertEqual(sm.tp_bytes_per_step(cfg, 1, 256, 2, 4), {"bytes": 23108608, "calls": 55})

    def test_tp_norm_allreduce(self):
        # 2L + 1 fp32 all-reduces of C per step (each layer's 2 RMSNorm weights + the final norm),
        # ring 2 (tp-1)/tp x 4C bytes each; dp_shard > 1: divided evenly (a model); tp 1: none.
        cfg = sm.load_config("llama-8b")
        self.assertEqual(sm.tp_norm_allreduce(cfg, 1), (0, 0.0))
        self.assertEqual(sm.tp_norm_allreduce(cfg, 2), (65, 65 * 2 * 1 / 2 * 4096 * 4))
        self.assertEqual(sm.tp_norm_allreduce(cfg, 8), (65, 65 * 2 * 7 / 8 * 4096 * 4))
        self.assertEqual(sm.tp_norm_allreduce(cfg, 8, dp_shard=8), (65 / 8, 65 * 2 * 7 / 8 * 4096 * 4 / 8))
        # Once per step, not per micro-batch.
        one = sm.tp_bytes_per_step(cfg, 1, 2048, 2, 2)
        three = sm.tp_bytes_per_step(cfg, 1, 2048, 2, 2, micro_batches=3)
        self.assertEqual(three["calls"] - 65, 3 * (one["calls"] - 65))
        self.assertAlmostEqual(three["bytes"] - 65 * 16384, 3 * (one["bytes"] - 65 * 16384), places=3)
        # In the CPU calls: 65 all-reduces of 4C bytes, whatever the number of micro-batches.
        calls = sm.tp_cpu_calls(cfg, 1, 2048, 2, 2, micro_batches=3)
        self.assertEqual(calls.count(("allreduce", "float32", 4096 * 4)), 65)

    def test_tp_bytes_match_e2e_formula(self):
        # tests/e2e/test_tensor_parallel.sh, item 5: the formula its C++ counters (metrics tp_bytes,
        # tp_collectives per step) pass, here for test-tp (src/model/config.cpp), 12 x 32 tokens,
        # fp32, one micro-batch per step, dp_shard 1; and the numbers the C++ measured.
        cfg = sm.Config("test-tp", 263, 96, 72, 2, 24, 12, True, head_dim=4)
        C, L, V, T, e = 96, 2, 263, 32, 4

        def formula(N, B, recompute, micro_batches=1, loss_chunk=0):
            BT = B * T
            R = BT // N
            ag, rs = (8 * L + 2, 5 * L + 2) if recompute == "full" else (6 * L + 2, 4 * L + 2)
            mb_bytes, mb_calls = (ag + rs) * (N - 1) * R * C * e, ag + rs
            chunk = min(loss_chunk or max(256, 2 ** 24 // -(-V // N)), BT)
            for start in range(0, BT, chunk):
                n = min(chunk, BT - start)
                mb_bytes += (N - 1) * n * 4 + 2 * (N - 1) / N * 2 * n * 4
                mb_calls += 2
            norms = 2 * L + 1
            return (micro_batches * mb_bytes + norms * 2 * (N - 1) / N * 4 * C, micro_batches * mb_calls + norms)

        for tp, recompute, measured in ((2, "none", 1776000), (4, "none", 2666304), (2, "full", 2218368),
                                        (4, "full", None)):
            want_bytes, want_calls = formula(tp, 12, recompute)
            if measured is not None:
                self.assertEqual(want_bytes, measured)
            b = sm.tp_bytes_per_microbatch(cfg, 12, 32, tp, e, recompute)
            nc, nb = sm.tp_norm_allreduce(cfg, tp)
            got = b["all_gather"] + b["reduce_scatter"] + b["all_reduce"] + nb
            self.assertAlmostEqual(got, want_bytes, delta=1e-9 * want_bytes)
            self.assertEqual(sum(b["calls"].values()) + nc, want_calls)
            self.assertEqual(sm.tp_bytes_per_step(cfg, 12, 32, tp, e, recompute=recompute),
                             {"bytes": got, "calls": want_calls})
        # The e2e's accumulation case: 4 micro-batches of 3 x 32, loss chunks of 40 tokens, tp 2.
        want_bytes, want_calls = formula(2, 3, "none", 4, 40)
        got = sm.tp_bytes_per_step(cfg, 3, 32, 2, e, micro_batches=4, loss_chunk=40)
        self.assertAlmostEqual(got["bytes"], want_bytes, delta=1e-9 * want_bytes)
        self.assertEqual(got["calls"], want_calls)

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
        # 194 all-gathers + 130 reduce-scatters, each alpha + F/2 / 450 GB/s. The loss: chunks of
        # default_loss_chunk(64,128) = 2^24 // 64,128 = 261 tokens, ceil(32,768 / 261) = 126 chunks,
        # each an all-gather of the maxima (alpha + 1/2 * 2n * 4 / B) and an all-reduce of 2n floats
        # (2 alpha + 2 * 1/2 * 8n / B): 126 * 3 alpha + 12 * 32768 / B. The norms, once per step:
        # 65 all-reduces of 4,096 fp32 over dp_shard = 64 / 2 = 32, divided evenly: 65/32 calls of
        # 2 alpha, 65 * 16384 / 32 bytes at 2 * 1/2 / B.
        cfg = sm.load_config("llama-8b")
        fab = sm.FABRICS["nvlink+ndr"]
        F = 16 * 2048 * 4096 * 2
        a, B = fab.a_intra, fab.B_intra
        expect = (324 * (a + F / 2 / B) + 126 * 3 * a + 12 * 32768 / B
                  + 65 / 32 * 2 * a + 65 * 16384 / 32 / B)
        r = sm.run_point(cfg, fab, 64, "fsdp", 1, sm.Precision("bf16-noslab"), sm.MFU_MEASURED, tp=2)
        self.assertAlmostEqual(r["tp"], expect, places=9)
        # The TP time is in 'compute' (it blocks); 'exposed' is FSDP's.
        r1 = sm.run_point(cfg, fab, 64, "fsdp", 1, sm.Precision("bf16-noslab"), sm.MFU_MEASURED)
        self.assertAlmostEqual(r["compute"] - r1["compute"], expect, places=9)
        self.assertEqual(r1["tp"], 0.0)

    def test_predict_tp_comm_by_hand(self):
        # scaling-config.json, micro-batch 1 x 256, tp 2, fp32: F = 256 * 1024 * 4 = 1 MiB total per
        # call (131,072 elements per rank: one MpiComm call). 26 all-gathers + 18 reduce-scatters of
        # S = F; the loss (one chunk of 256): an all-gather of the maxima, S = 2 * 256 * 4 = 2 KiB, and
        # an all-reduce of 2 KiB, timed as reduce-scatter + all-gather (the hand-made file has no
        # all-reduce): 47 calls per micro-batch. Once per step, the norms: 9 all-reduces of 1,024
        # fp32 (4 KiB), each a reduce-scatter + an all-gather: 18 calls. The hand-made machine:
        # t = alpha + S / BW.
        cfg = sm.load_config(CONFIG)
        F = 256 * 1024 * 4
        mb = 47 * ALPHA + (44 * F + 2048 + 2 * 2048) / BW
        norms = 18 * ALPHA + 18 * 4096 / BW
        expect = mb + norms
        got = sm.predict_tp_comm(cfg, 1, 256, 2, 4, sm.load_bench(self.bench))
        self.assertAlmostEqual(got, expect, places=12)
        self.assertEqual(len(sm.tp_cpu_calls(cfg, 1, 256, 2, 4)), 27 + 18 + 1 + 9)
        self.assertAlmostEqual(sm.predict_tp_comm(cfg, 1, 256, 2, 4, sm.load_bench(self.bench), micro_batches=3),
                               3 * mb + norms, places=12)
        full = expect + 4 * 3 * ALPHA + 4 * 3 * F / BW
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

    def test_cp_bytes_by_hand(self):
        # tiny (C 32, 4 heads over 2 KV heads of 8), tp 2: 1 KV head per rank, KV = 8; B 2, T 16,
        # cp 4: Tl 4; bf16: a K block b = 2 x 4 x 8 x 2 = 128 bytes; document: positions and ids,
        # 2 x 4 tokens x 4 B x 2 arrays = 64 bytes per shift or per rank's part of a gather.
        t = sm.load_config("tiny")
        r = sm.cp_bytes_per_layer(t, 2, 16, 4, "ring", 2, doc=True, tp=2)
        self.assertEqual(r["forward"], 3 * (2 * 128 + 64))
        self.assertEqual(r["backward"], 3 * (2 * 128 + 64) + 4 * 2 * 128)
        self.assertEqual(r["calls"], 2 * 3 * 4 + 2 * 4)  # k, v, positions, ids per shift; 2 x cp dK/dV shifts
        g = sm.cp_bytes_per_layer(t, 2, 16, 4, "allgather", 2, doc=True, tp=2)
        self.assertEqual(g["forward"], 3 * (2 * 128 + 64))
        self.assertEqual(g["backward"], 3 * (2 * 128 + 64) + 3 * 2 * 128)
        self.assertEqual(g["calls"], 2 * 2 * 2 + 6 * 2 * 1)  # per sequence: ids twice; per chunk: 6
        self.assertEqual(sm.cp_bytes_per_step(t, 2, 16, 4, "ring", 2, True, 2, micro_batches=2)["bytes"],
                         2 * t.L * r["bytes"])
        with self.assertRaises(ValueError):
            sm.cp_bytes_per_layer(t, 1, 12, 4, "ring", 4)  # T must divide by 2 cp

    def test_cp_time_by_hand(self):
        # tiny, B 1, T 8, cp 2, fp32, 1 GFLOP/s at MFU 1, 1 MB/s, alpha 0: a rank's 4 tokens.
        t = sm.load_config("tiny")
        attn_f = 4 * 32 * 8 * 4 / 1e9                    # 4 Q T per token forward
        gemm_f = 2 * t.block_numel() * 4 / 1e9
        r = sm.cp_layer_time(t, 1, 8, 2, "ring", 1.0, 1e6, 0.0, e=4, peak=1e9)
        self.assertAlmostEqual(r["compute_s"], 3 * (attn_f + gemm_f), places=15)
        # K/V block 4 x 16 x 4 = 256 B: a forward shift 528 B (K, V, positions) = 528 us against
        # half the attention; backward K/V + dK/dV 1040 B against the other half of twice that;
        # the last dK/dV shift (512 B) exposed whole.
        want = (528e-6 - attn_f / 2) + (1040e-6 - attn_f) + 512e-6
        self.assertAlmostEqual(r["exposed_s"], want, places=12)
        g = sm.cp_layer_time(t, 1, 8, 2, "allgather", 1.0, 1e6, 0.0, e=4, peak=1e9)
        self.assertAlmostEqual(g["exposed_s"], (528 + 528 + 512) * 1e-6, places=12)  # blocking: bytes / B
        self.assertEqual(sm.cp_layer_time(t, 1, 8, 1, "ring", 1.0, 1e6, 0.0, e=4, peak=1e9)["exposed_s"], 0.0)

    def test_cp_table_in_docs(self):
        # docs/scaling.md's CP table is the script's output, verbatim.
        out = io.StringIO()
        sm.cp_tables(True, out)
        with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
            self.assertIn(out.getvalue(), f.read())


    # ---- pipeline parallelism (issue 42, item 8) ----

    def test_pp_bubble_formulas_by_hand(self):
        # GPipe / 1F1B: (P-1)/(m+P-1); P 4, m 8: 3/11 (GPipe section 2.2; Narayanan et al. 2021).
        self.assertAlmostEqual(sm.pp_bubble_fraction("gpipe", 4, 8), 3 / 11, places=15)
        self.assertAlmostEqual(sm.pp_bubble_fraction("1f1b", 4, 8), 3 / 11, places=15)
        # Interleaved, v 2: (3/2) / (8 + 3/2) = 3/19 (Narayanan et al. 2021, section 2.2.2).
        self.assertAlmostEqual(sm.pp_bubble_fraction("interleaved", 4, 8, v=2), 3 / 19, places=15)
        # ZB-H1 with tf = ti = tw: (P-1) tf / (3 m tf + (P-1) tf) = 3/27 (Qi et al. 2024, section 3.1).
        self.assertAlmostEqual(sm.pp_bubble_fraction("zb-h1", 4, 8), 1 / 9, places=15)
        # ZB-H1, tf 1, ti 1.2, tw 0.8: bubble 3 x (1 + 1.2 - 0.8) = 4.2 of 8 x 3 + 4.2 = 28.2.
        self.assertAlmostEqual(sm.pp_bubble_fraction("zb-h1", 4, 8, tf=1.0, ti=1.2, tw=0.8), 4.2 / 28.2, places=15)
        self.assertAlmostEqual(sm.pp_bubble_time("zb-h1", 4, 1.0, 1.2, 0.8), 4.2, places=15)
        self.assertEqual(sm.pp_bubble_fraction("1f1b", 1, 8), 0.0)
        with self.assertRaises(ValueError):
            sm.pp_bubble_time("dualpipe", 4, 1.0, 1.0, 1.0)

    def test_pp_bubble_shrinks_with_micro_batches(self):
        for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1)):
            fr = [sm.pp_bubble_fraction(s, 8, m, v=v) for m in range(1, 129)]
            self.assertTrue(all(a > b for a, b in zip(fr, fr[1:])), s)
        # and interleaving / ZB-H1 shrink it at a given m: 1f1b > interleaved v 2 > v 4; 1f1b > zb-h1.
        self.assertGreater(sm.pp_bubble_fraction("1f1b", 8, 16), sm.pp_bubble_fraction("interleaved", 8, 16, v=2))
        self.assertGreater(sm.pp_bubble_fraction("interleaved", 8, 16, v=2), sm.pp_bubble_fraction("interleaved", 8, 16, v=4))
        self.assertGreater(sm.pp_bubble_fraction("1f1b", 8, 16), sm.pp_bubble_fraction("zb-h1", 8, 16))

    def test_pp_chunks_and_p2p_bytes(self):
        # llama-405b: 126 layers + embedding + head = 128 blocks; pp 16: 8 each (Llama 3's split:
        # 7 layers + the embedding on the first stage, 7 + the head on the last).
        c = sm.load_config("llama-405b")
        self.assertEqual((c.L, c.C, c.NH, c.NKV, c.I, c.V), (126, 16384, 128, 8, 53248, 128256))
        ch = sm.pp_chunks(c, 16)
        self.assertEqual([len(x) for x in ch], [8] * 16)
        self.assertEqual((ch[0][0], ch[-1][-1]), (0, 127))
        # llama-70b: 82 blocks over 4 stages: 21, 21, 20, 20.
        self.assertEqual([len(x) for x in sm.pp_chunks(sm.load_config("llama-70b"), 4)], [21, 21, 20, 20])
        # b T / (tp cp) x C x e: 1 x 8192 / 8 x 16384 x 2 = 32 MiB per micro-batch and boundary.
        self.assertEqual(sm.pp_p2p_bytes(1, 8192, 16384, 8), 33554432)
        self.assertEqual(sm.pp_p2p_bytes(2, 8192, 16384, 8, cp=2), 33554432)

    def test_pp_step_by_hand(self):
        # An untied toy: V 64, C 32, I 64, L 2, 4 heads / 2 KV heads (head 8: Q 32, KV 16), T 16.
        # layer = 2C + C Q + 2 C KV + Q C + 3 C I = 64 + 1024 + 1024 + 1024 + 6144 = 9280;
        # N = 2 V C + L layer + C = 4096 + 18560 + 32 = 22688; flops_per_token = 6 N + 12 L Q T = 148416.
        # Real FLOPs per token: layer forward 2 x 9280 + 4 Q T = 20608, backward 41216, head 6 V C = 12288;
        # sum 2 x 20608 + 2 x 41216 + 12288 = 135936. One sequence per micro-batch (16 tokens, tp 1) at
        # 1 GFLOP/s: 148416 x 16 / 1e9 s, spread in those proportions (scale = that / 135936).
        cfg = sm.Config("toy", 64, 32, 64, 2, 4, 2, False)
        self.assertEqual(cfg.block_numel(), 9280)
        self.assertEqual(sm.flops_per_token(cfg, 16), 148416)
        scale = 148416 * 16 / 1e9 / 135936
        # pp 2 over W = 2 (dp 1: FSDP moves nothing): chunks [embed, layer 0], [layer 1, head]. The
        # slowest stage is the second: tf = layer fwd + head / 3, tb = layer bwd + 2 head / 3.
        tf, tb = scale * (20608 + 4096), scale * (41216 + 8192)
        tw = scale * (2 * 9280 + 2 * 64 * 32)       # weight-gradient GEMMs: 2 P_layer + the head's 2 V C
        # The hand machine: 1 GB/s, 10 us a hop, one node: a transfer of 16 x 32 x 2 bytes = 11.024 us.
        fab = sm.Fabric("hand", 1, 8, 1, 10.0, 10.0)
        t_p2p = 10e-6 + 16 * 32 * 2 / 1e9
        # 1F1B, m 4 (global batch 4 sequences): 4 (tf + tb) + (2 - 1)(tf + tb), + the fill and drain
        # transfers 2 (P - 1) t_p2p (each smaller than the action it overlaps in the steady state).
        r = sm.pp_point(cfg, fab, 2, 2, 1, "1f1b", 1, 1, 4 * 16, T=16, mfu=1.0, peak=1e9, prec=sm.Precision("fp32"))
        self.assertEqual(r["m"], 4)
        self.assertAlmostEqual(r["tf"], tf, places=15)
        self.assertAlmostEqual(r["ti"] + r["tw"], tb, places=15)
        self.assertAlmostEqual(r["tw"], tw, places=15)
        self.assertAlmostEqual(r["t_p2p"], t_p2p, places=15)
        self.assertEqual(r["fsdp"], 0.0)
        want = 5 * (tf + tb) + 2 * t_p2p
        self.assertAlmostEqual(r["step"], want, places=15)
        self.assertAlmostEqual(r["tok_s"], 64 / 2 / want, places=6)
        self.assertAlmostEqual(r["bubble"], 1 / 5, places=15)
        # Interleaved v 2, m 4: chunks [embed], [layer 0], [layer 1], [head]; rank 1 holds layer 0 and
        # the head: the same tf, tb. Bubble (tf + tb) / 2; 2 (P v - 1) = 6 transfers on the path.
        ri = sm.pp_point(cfg, fab, 2, 2, 1, "interleaved", 2, 1, 4 * 16, T=16, mfu=1.0, peak=1e9, prec=sm.Precision("fp32"))
        self.assertAlmostEqual(ri["step"], 4 * (tf + tb) + (tf + tb) / 2 + 6 * t_p2p, places=15)
        # ZB-H1: bubble (tf + ti - tw) = tf + tb - 2 tw.
        rz = sm.pp_point(cfg, fab, 2, 2, 1, "zb-h1", 1, 1, 4 * 16, T=16, mfu=1.0, peak=1e9, prec=sm.Precision("fp32"))
        self.assertAlmostEqual(rz["step"], 4 * (tf + tb) + (tf + tb - 2 * tw) + 2 * t_p2p, places=15)
        with self.assertRaises(ValueError):  # interleaved needs m a multiple of pp
            sm.pp_point(cfg, fab, 2, 2, 1, "interleaved", 2, 1, 3 * 16, T=16, mfu=1.0, peak=1e9)

    def test_pp1_is_run_point(self):
        # pp 1 with one micro-batch per step is the existing FSDP x TP prediction, exactly.
        fab = sm.FABRICS["nvlink+ndr"]
        prec = sm.Precision("bf16-noslab")
        for mname, W, tp, b in (("llama-8b", 64, 1, 8), ("llama-8b", 64, 2, 16), ("llama-70b", 256, 8, 8)):
            cfg = sm.load_config(mname)
            dp = W // tp
            r = sm.pp_point(cfg, fab, W, 1, tp, micro_batch=b, global_tokens=dp * b * 2048, T=2048,
                            mfu=sm.MFU_MEASURED, prec=prec)
            ref = sm.run_point(cfg, fab, W, "fsdp", 1, prec, sm.MFU_MEASURED, tokens=b * 2048 // tp, tp=tp)
            self.assertEqual(r["m"], 1)
            self.assertEqual(r["step"], ref["step"])
            self.assertEqual(r["tok_s"], ref["tok_s"])
            # m micro-batches: m x (step - the norms' once-per-step all-reduce) + it once.
            r3 = sm.pp_point(cfg, fab, W, 1, tp, micro_batch=b, global_tokens=3 * dp * b * 2048, T=2048,
                             mfu=sm.MFU_MEASURED, prec=prec)
            tn = sm.tp_norm_time(cfg, sm.Topology(fab, W, "fsdp", tp))
            self.assertAlmostEqual(r3["step"], 3 * (ref["step"] - tn) + tn, places=9)

    def test_pp_memory_by_hand(self):
        # llama-405b, W 512, pp 8, tp 8, b 1, T 8192, 1f1b, m 32, full: rank 0 holds min(8, 32) x 126/8
        # layer-micro-batches of 2 b T C / tp bytes; state 16 B x its blocks' slices over dp 8;
        # buffers 2 x 6 B x the largest slice: a layer's at tp 8, 2C + (C Q + 2 C KV + Q C + 3 C I) / 8 =
        # 32768 + (268435456 + 33554432 + 268435456 + 2617245696) / 8 = 398491648 (the embedding's
        # 16032 x 16384 = 262668288 is smaller).
        c = sm.load_config("llama-405b")
        us = sm.units(c, 8)
        blocks0 = sm.pp_chunks(c, 8)[0]
        state = 16 * sum(sm.shard_size(us[k][1], 8) for k in blocks0)
        act = 8 * 126 / 8 * 2 * 8192 * 16384 / 8
        want = state + 12 * 398491648 + act
        self.assertEqual((us[0][1], us[1][1]), (16032 * 16384, 398491648))
        self.assertAlmostEqual(sm.pp_memory(c, 512, 8, 8, 1, 8192, "1f1b", 1, 32, "full"), want, delta=1)

    # ---- expert parallelism (issue 56) ----

    def test_moe_param_counts_by_hand(self):
        # mixtral-8x7b (src/model/config.cpp, transformers' count): V 32000, C 4096, L 32, 32 heads / 8 KV
        # heads of 128, untied, 8 experts of 3 C 14336, top 2, router [8, C], no bias.
        C, V, L = 4096, 32000, 32
        attn = 2 * C + C * C + 2 * C * 1024 + C * C
        expert = 3 * C * 14336
        total = 2 * V * C + C + L * (attn + C * 8 + 8 * expert)
        active = 2 * V * C + C + L * (attn + C * 8 + 2 * expert)
        self.assertEqual((total, active), (46702792704, 12879925248))
        mx = sm.load_moe_config("mixtral-8x7b")
        self.assertEqual((mx.num_params(), mx.num_active_params()), (total, active))
        # qwen3-30b-a3b: head_dim 128 (Q 4096, KV 512), q/k norms [128], 128 experts of 768, top 8.
        C, V, L = 2048, 151936, 48
        attn = 2 * C + C * 4096 + 2 * C * 512 + 4096 * C + 2 * 128
        e = 3 * C * 768
        q3 = sm.load_moe_config("qwen3-30b-a3b")
        self.assertEqual((q3.num_params(), q3.num_active_params()),
                         (2 * V * C + C + L * (attn + C * 128 + 128 * e), 2 * V * C + C + L * (attn + C * 128 + 8 * e)))
        self.assertEqual((q3.num_params(), q3.num_active_params()), (30532122624, 3353032704))
        # DeepSeek-V3's shape with multi-head attention of head_dim 7168 / 128 = 56: 3 dense layers (MLP
        # 18432), 58 MoE layers (router [256, C], 256 experts of 2048, top 8, a shared expert of 2048).
        C, V = 7168, 129280
        attn = 2 * C + 4 * C * C
        e = 3 * C * 2048
        head = 2 * V * C + C
        ds = sm.load_moe_config("deepseek-v3-mha")
        self.assertEqual(ds.num_params(), head + 61 * attn + 3 * 3 * C * 18432 + 58 * (C * 256 + 257 * e))
        self.assertEqual(ds.num_active_params(), head + 61 * attn + 3 * 3 * C * 18432 + 58 * (C * 256 + 9 * e))
        self.assertEqual((ds.num_params(), ds.num_active_params()), (672149632000, 38675510272))
        # With MLA (config_671B.json: q_lora 1536, kv_lora 512, nope 128, rope 64, v 128) and the gate's
        # bias [256]: 671,026,419,200, DeepSeek's 671B.
        mla = 2 * C + C * 1536 + 1536 + 1536 * 128 * 192 + C * 576 + 512 + 512 * 128 * 256 + 128 * 128 * C
        self.assertEqual(sm.mla_attn_numel(C, 128, 1536, 512, 128, 64, 128), mla)
        self.assertEqual(sm.dsv3_mla_counts(ds)[0], ds.num_params() + 61 * (mla - attn) + 58 * 256)
        self.assertEqual(sm.dsv3_mla_counts(ds)[0], 671026419200)
        # The compute counts the active parameters: 6 N_active + 12 L Q T.
        self.assertEqual(sm.moe_flops_per_token(mx, 4096), 6.0 * 12879925248 + 12.0 * 32 * 4096 * 4096)

    def test_a2a_bytes_and_time_by_hand(self):
        # A made-up model: C 16, top 2. 10 tokens, ep 4, bf16: 10 x 2 x 16 x 2 = 640 bytes of slots, 3/4
        # of them leave: 480 bytes.
        toy = sm.MoeConfig("toy", 64, 16, 32, 1, 2, 2, True, 8, 2, 8)
        self.assertEqual(sm.ep_a2a_bytes(toy, 10, 4), 480)
        self.assertEqual(sm.ep_a2a_bytes(toy, 10, 1), 0)
        # One node (ep x tp <= 8), NVLink 1 GB/s, 10 us: (ep-1) alpha + 480 / B.
        fab = sm.Fabric("hand", 1, 8, 8, 10.0, 20.0)  # NICs: 8 x 1 GB/s per node, B_rail 1 GB/s
        self.assertAlmostEqual(sm.ep_a2a_time(fab, 4, 1, 640), 3 * 10e-6 + 480 / 1e9, places=15)
        self.assertAlmostEqual(sm.ep_a2a_time(fab, 4, 2, 640), 3 * 10e-6 + 480 / 1e9, places=15)
        # Across nodes: ep 16 (tp 1) = 2 nodes; 8/16 of the bytes go to the other node at B_rail (1 GB/s),
        # 7/16 to the GPU's own node over NVLink (1 GB/s) meanwhile: 15 x 20 us + 320 / 1e9.
        self.assertAlmostEqual(sm.ep_a2a_time(fab, 16, 1, 640), 15 * 20e-6 + 320 / 1e9, places=15)
        # tp 4, ep 4: 16 ranks, 2 of the group per node: 2/4 leave the node.
        self.assertAlmostEqual(sm.ep_a2a_time(fab, 4, 4, 640), 3 * 20e-6 + 320 / 1e9, places=15)
        self.assertEqual(sm.ep_a2a_time(fab, 1, 1, 640), 0.0)

    def test_expert_unit_gather_bytes_divided_by_ep(self):
        # mixtral-8x7b over dp 64, bf16 gather / fp32 reduce. Without EP a layer's unit holds all 8
        # experts: its experts' part of a gather is 63/64 x 8 x 3 C I x 2 bytes. With expert units and
        # ep 8 an EP rank gathers its one expert over the 64 / 8 = 8 ranks holding it: 7/8 x 3 C I x 2.
        mx = sm.load_moe_config("mixtral-8x7b")
        pr = sm.Precision("bf16")
        e = 3 * 4096 * 14336  # one expert; divides 8 and 64
        b8 = sm.ep_fsdp_bytes(mx, 64, pr, ep=8)
        self.assertEqual(b8["expert"], (32 * 2 * 7 / 8 * e * 2, 32 * 1 * 7 / 8 * e * 4))
        b1 = sm.ep_fsdp_bytes(mx, 64, pr, ep=1)  # expert units, no EP: all 8 experts over 64
        self.assertEqual(b1["expert"], (32 * 2 * 63 / 64 * 8 * e * 2, 32 * 63 / 64 * 8 * e * 4))
        # Divided by ep (and the ring factor (n-1)/n of the smaller ring): 1/8 x (7/8) / (63/64).
        self.assertAlmostEqual(b8["expert"][0] / b1["expert"][0], (7 / 8) / (63 / 64) / 8, places=15)
        # The dense units do not change; as built (experts in the layer's unit) = expert units at ep 1.
        self.assertEqual(b8["dense"], b1["dense"])
        built = sm.ep_fsdp_bytes(mx, 64, pr, ep=8, expert_units=False)
        self.assertEqual(built["expert"], (0.0, 0.0))
        self.assertAlmostEqual(built["dense"][0], b1["dense"][0] + b1["expert"][0], delta=1e-3)
        # Per GPU, the experts' sharded state is the same with or without expert units: E / (dp tp).
        st = lambda units, ep: sum(sm.shard_size(n, 64 if k == "dense" else 64 // ep)
                                   for _, n, k in sm.moe_units(mx, 1, ep, units) if k == "expert")
        self.assertEqual(st(True, 8) * 8, st(True, 1) * 8)
        self.assertEqual(st(True, 8), 32 * 8 * e // 64)

    def test_ep_refusals(self):
        mx = sm.load_moe_config("mixtral-8x7b")
        for ep in (3, 5, 16):  # 8 experts
            with self.assertRaises(ValueError):
                sm.moe_units(mx, 1, ep)
        with self.assertRaises(ValueError):
            sm.check_moe(sm.load_moe_config("deepseek-v3-mha"), 1, 48)  # 256 experts
        with self.assertRaises(ValueError):  # ep must divide dp (EP groups inside the shard group)
            sm.ep_point(mx, sm.FABRICS["nvlink+ndr"], 256, ep=8, tp=8, pp=8)
        with self.assertRaises(ValueError):
            sm.MoeConfig("bad", 64, 16, 32, 1, 2, 2, True, 4, 5, 8)  # top 5 of 4 experts
        with self.assertRaises(TypeError):
            mx.block_numel()  # MoE layers have no single size

    def _toy(self):
        # V 64, C 32, I 64, L 2, 4 heads / 2 KV heads of 8 (Q 32, KV 16), untied; 4 experts of 16, top 2.
        # attention 2C + C Q + 2 C KV + Q C = 3136; router C E = 128; an expert 3 C 16 = 1536.
        # Layer 3136 + 128 + 4 x 1536 = 9408; N = 2 V C + C + 2 x 9408 = 22944; active 16800.
        # flops_per_token at T 16: 6 x 16800 + 12 x 2 x 32 x 16 = 113088.
        t = sm.MoeConfig("toy-moe", 64, 32, 64, 2, 4, 2, False, 4, 2, 16)
        self.assertEqual((t.num_params(), t.num_active_params(), sm.moe_flops_per_token(t, 16)), (22944, 16800, 113088))
        return t

    def test_ep_step_by_hand(self):
        # The toy at W 2, dp 2, ep 2, tp 1, one sequence of 16 tokens per GPU, one micro-batch, 1 GFLOP/s
        # at MFU 1, everything blocking (prefetch 0) on a 1 GB/s, 10 us machine (one node).
        t = self._toy()
        fab = sm.Fabric("hand", 1, 8, 1, 10.0, 10.0)
        a, B = 10e-6, 1e9
        compute = 113088 * 16 / 1e9
        # FSDP, expert units: embedding 2048, two layers 3264 (attention + router), final norm + head 2080,
        # over 2 ranks (S 1024, 1632, 1632, 1040); the expert units (2 experts, 3072) over dp / ep = 1
        # rank: no traffic. Gathers (bf16): embedding once, layers twice, head once: 6 calls of
        # alpha + S x 2 / B; reduce-scatters (fp32) once each: 4 of alpha + S x 4 / B.
        fsdp = 10 * a + (2 * (1024 + 4 * 1632 + 1040) + 4 * (1024 + 2 * 1632 + 1040)) / B
        # All-to-alls: 16 tokens x 2 slots x 32 x 2 bytes = 2048 per GPU, half leaves: alpha + 1024 / B,
        # 5 per layer; the counts' all-gather, 2 ranks x 4 x 8 bytes: alpha + 32 / B, once per layer.
        a2a = 2 * (5 * (a + 1024 / B) + a + 32 / B)
        kw = dict(ep=2, tp=1, pp=1, micro_batch=1, global_tokens=32, T=16, mfu=1.0, peak=1e9,
                  prec=sm.Precision("bf16-noslab"), prefetch=0)
        r = sm.ep_point(t, fab, 2, **kw)
        self.assertEqual(r["m"], 1)
        self.assertAlmostEqual(r["t_compute"], compute, places=15)
        self.assertAlmostEqual(r["t_fsdp"], fsdp, places=15)
        self.assertAlmostEqual(r["t_a2a"], a2a, places=15)
        self.assertAlmostEqual(r["step"], compute + fsdp + a2a, places=15)
        self.assertAlmostEqual(r["tok_s"], 16 / (compute + fsdp + a2a), places=6)
        self.assertAlmostEqual(r["mfu"], r["tok_s"] * 113088 / 1e9, places=12)
        # As built: the experts stay in the layer's unit, 3264 + 6144 = 9408 (S 4704 over 2 ranks).
        built = 10 * a + (2 * (1024 + 4 * 4704 + 1040) + 4 * (1024 + 2 * 4704 + 1040)) / B
        rb = sm.ep_point(t, fab, 2, expert_units=False, **kw)
        self.assertAlmostEqual(rb["t_fsdp"], built, places=15)
        self.assertAlmostEqual(rb["step"], compute + built + a2a, places=15)
        # Overlapped: the all-to-alls (about 0.1 ms) hide behind the layer's compute (about 0.4 ms).
        ro = sm.ep_point(t, fab, 2, a2a_overlap=True, **kw)
        self.assertEqual(ro["t_a2a"], 0.0)
        self.assertAlmostEqual(ro["step"], compute + fsdp, places=15)
        # No EP: no all-to-all.
        self.assertEqual(sm.ep_point(t, fab, 2, **dict(kw, ep=1))["t_a2a"], 0.0)
        # Full recompute: 7 all-to-alls and 2 counts a layer (the forward's again).
        rf = sm.ep_point(t, fab, 2, recompute="full", **kw)
        self.assertAlmostEqual(rf["t_a2a"], 2 * (7 * (a + 1024 / B) + 2 * (a + 32 / B)), places=15)

    def test_ep_pipeline_by_hand(self):
        # The toy on 2 GPUs as pp 2 (dp 1: no FSDP traffic), 1F1B, 4 micro-batches of one sequence:
        # stages [embedding, layer 0], [layer 1, head]; the second is slower. Per token FLOPs: a layer's
        # forward 2 x 6336 + 4 Q T = 14720, backward 29440; the head 6 V C = 12288 (1/3 forward).
        # The compute, 113088 x 16 / 1e9 s per micro-batch, spread in those proportions (sum 100608).
        t = self._toy()
        fab = sm.Fabric("hand", 1, 8, 1, 10.0, 10.0)
        scale = 113088 * 16 / 1e9 / 100608
        tf, tb = scale * (14720 + 4096), scale * (29440 + 8192)
        t_p2p = 10e-6 + 16 * 32 * 2 / 1e9
        r = sm.ep_point(t, fab, 2, ep=1, tp=1, pp=2, micro_batch=1, global_tokens=4 * 16, T=16, mfu=1.0, peak=1e9,
                        prec=sm.Precision("fp32"))
        self.assertEqual((r["m"], r["t_fsdp"]), (4, 0.0))
        self.assertAlmostEqual(r["step"], 5 * (tf + tb) + 2 * t_p2p, places=15)
        self.assertAlmostEqual(r["bubble_frac"], 1 / 5, places=15)
        self.assertAlmostEqual(r["t_compute"] + r["t_tp"] + r["t_fsdp"] + r["t_a2a"] + r["t_bubble"], r["step"], places=15)

    def test_ep_memory_by_hand(self):
        # The toy at W 2, P 1, dp 2, ep 2, one sequence of 16, recompute none, expert units.
        # state 16 B x (shards over 2: 1024 + 1632 + 1632 + 1040; expert units over 1: 2 x 3072) = 183,552;
        # FSDP buffers 2 x 6 B x the largest unit (a layer, 3264) = 39,168. An MoE layer keeps
        # 15 b T C = 7,680 (attention, norms), 4 b T (E + k) = 384 (router), 2 (3 rows IE + slots C): slots
        # b T k = 32, rows 32 balanced (5,120), 2 x 32 = 64 at the worst (8,192); two layers. Scratch:
        # 2 (3 rows IE + 2 slots C + 3 rows C): 13,312 balanced, 22,528 worst.
        t = self._toy()
        bal = sm.ep_memory(t, 2, 1, 1, 2, 1, 16, "1f1b", 1, 1, "none", True, "balanced")
        worst = sm.ep_memory(t, 2, 1, 1, 2, 1, 16, "1f1b", 1, 1, "none", True, "worst")
        self.assertEqual((bal["state"], bal["fsdp"]), (183552, 39168))
        self.assertEqual((bal["act"], worst["act"]), (2 * (7680 + 384 + 5120), 2 * (7680 + 384 + 8192)))
        self.assertEqual((bal["scratch"], worst["scratch"]), (13312, 22528))
        self.assertEqual((bal["total"], worst["total"]), (262400, 277760))
        # Full recompute keeps 2 b T C per layer and adds one MoE layer's kept buffers to the scratch.
        full = sm.ep_memory(t, 2, 1, 1, 2, 1, 16, "1f1b", 1, 1, "full", True, "balanced")
        self.assertEqual((full["act"], full["scratch"]), (2 * 2 * 16 * 32, 13312 + 7680 + 384 + 5120))

    def test_ep_table_in_docs(self):
        # docs/scaling.md's EP tables are the script's output (ep-tables), verbatim (about 15 s).
        with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
            doc = f.read()
        for fn in (sm.ep_layer_table, sm.ep_tables):
            out = io.StringIO()
            fn(out)
            self.assertIn(out.getvalue(), doc)


if __name__ == "__main__":
    unittest.main(verbosity=2)
