#!/usr/bin/env python3
"""Model of shardtrain's FSDP (ZeRO-3) step time: compute from an MFU, communication from the shard
plan, a ring cost model (alpha-beta) and an overlap schedule with prefetch. Stdlib only,
deterministic (no clocks, no randomness). docs/scaling.md explains the model and holds its tables.

Subcommands
  plan     per-unit element counts of the shard plan (as src/model/llama.cpp's llama_units and
           src/shard/shard_plan.cpp's ShardPlan::build make them) and bytes per step per rank
  tables   the scaling tables of docs/scaling.md (llama-1b, llama-8b; FSDP / HSDP; prefetch 1 / 2;
           W = 8 .. 1024; NVLink, InfiniBand NDR, 100 GbE); --markdown for the document
  check    the communication part applied to a CPU run: predicted comm_ms (and exposed_comm_ms)
           per step from comm_bandwidth's measured times, against shardtrain's --metrics files
  tp-tables tokens/s per GPU with tensor + sequence parallelism (llama-8b, llama-70b; W = 64, 256,
           1024; tp 1, 2, 4, 8): docs/scaling.md, "Tensor parallelism (issue 31)"; plan --tp too
  predict-tp-cpu  the TP collectives of a CPU run (predict_tp_comm) from comm_bandwidth's times
  cp-tables context parallelism (issue 41): bytes per layer of --cp-comm ring and allgather and their
           exposed time on NVLink for llama-8b at 32K and 128K tokens, cp 2, 4, 8 (docs/scaling.md)
  cp-bytes cp_bytes / cp_collectives per step of a CPU run, as its metrics count them
  pp-tables pipeline parallelism (issue 42): best mesh with and without PP for llama-70b and
           llama-405b at W = 256 .. 4096 (and 8192, 16384), 16M-token batch, seq 8192, and the model
           beside Llama 3's table 4 and torchtitan's table 5 (docs/scaling.md)
  ep-tables expert parallelism (issue 56): one MoE layer's all-to-alls and expert gathers, and the
           best mesh with and without EP for mixtral-8x7b and a DeepSeek-V3-sized model (MHA in place
           of MLA) at W = 256 .. 4096, 16M-token batch, seq 4096 (docs/scaling.md)
  selftest the arithmetic checks (also run by tests/bench/test_scaling_model.py)

Examples
  scripts/scaling_model.py plan --model llama-1b --world 8
  scripts/scaling_model.py tables --markdown
  scripts/scaling_model.py tp-tables --markdown
  scripts/scaling_model.py predict-tp-cpu --tp 2 --seq-len 256 --micro-batch 1 --bandwidth-json build-cpu/comm.jsonl
  scripts/scaling_model.py check --model tests/bench/scaling-config.json --seq-len 256 --micro-batch 1 \\
      --precision fp32 --bandwidth-json build-cpu/comm.jsonl \\
      --metrics m2.jsonl --world 2 --metrics m4.jsonl --world 4

Units: bytes, seconds (ms in printed tables), GB = 1e9 bytes, FLOP/s.
"""

import argparse
import bisect
import json
import os
import sys

# --------------------------------------------------------------------------------------------
# Model shapes: shardtrain's presets (src/model/config.cpp), or a Hugging Face config.json.

PRESETS = {
    # name: (V, C, I, L, NH, NKV, tied)
    "tiny": (258, 32, 64, 2, 4, 2, True),
    "demo": (258, 128, 384, 4, 4, 4, True),
    "llama-125m": (32000, 768, 2048, 12, 12, 12, True),
    "llama-350m": (32000, 1024, 2816, 24, 16, 16, True),
    "llama-1b": (128256, 2048, 8192, 16, 32, 8, True),  # meta-llama/Llama-3.2-1B
    "tinyllama-1.1b": (32000, 2048, 5632, 22, 32, 4, False),
    "llama-8b": (128256, 4096, 14336, 32, 32, 8, False),  # meta-llama/Llama-3.1-8B
    "llama-70b": (128256, 8192, 28672, 80, 64, 8, False),  # meta-llama/Llama-3.1-70B
    "llama-405b": (128256, 16384, 53248, 126, 128, 8, False),  # meta-llama/Llama-3.1-405B
}


class Config:
    def __init__(self, name, V, C, I, L, NH, NKV, tied, head_dim=None):
        self.name, self.V, self.C, self.I, self.L = name, V, C, I, L
        self.NH, self.NKV, self.tied = NH, NKV, tied
        self.HD = head_dim if head_dim else C // NH

    @property
    def Q(self):  # query width NH * head_dim
        return self.NH * self.HD

    @property
    def KV(self):
        return self.NKV * self.HD

    def block_numel(self, tp=1):
        # ModelConfig::num_params' block: 2 norms + q, k, v, o + gate, up, down. With tensor
        # parallelism, one TP rank's slice: q/k/v rows, o columns, gate/up rows and down columns
        # divided by tp, the two RMSNorm weights [C] replicated (check_tp: tp divides NH, NKV, I).
        C, Q, KV, I = self.C, self.Q // tp, self.KV // tp, self.I // tp
        return 2 * C + C * Q + 2 * C * KV + Q * C + 3 * C * I

    def vocab_rows(self, tp=1):
        """Rows of the embedding (and lm_head) per TP rank: Vp / tp, Vp = V rounded up to a
        multiple of tp (vocabulary parallelism)."""
        return -(-self.V // tp)

    def num_params(self):
        return self.V * self.C + self.L * self.block_numel() + self.C + (0 if self.tied else self.V * self.C)


def load_config(spec):
    """A preset name or a path to a Hugging Face config.json (the fields shardtrain reads)."""
    if spec in PRESETS:
        V, C, I, L, NH, NKV, tied = PRESETS[spec]
        return Config(spec, V, C, I, L, NH, NKV, tied)
    with open(spec) as f:
        j = json.load(f)
    return Config(os.path.basename(spec), j["vocab_size"], j["hidden_size"], j["intermediate_size"],
                  j["num_hidden_layers"], j["num_attention_heads"],
                  j.get("num_key_value_heads", j["num_attention_heads"]),
                  bool(j.get("tie_word_embeddings", False)), j.get("head_dim"))


def check_tp(cfg, tp):
    """tp must divide the heads, the KV heads and the MLP width (the shards of q/k/v, o, gate/up,
    down); the vocabulary is padded instead (Config.vocab_rows)."""
    if tp < 1 or cfg.NH % tp or cfg.NKV % tp or cfg.I % tp:
        raise ValueError("tp %d must divide heads %d, KV heads %d and intermediate %d of %s" %
                         (tp, cfg.NH, cfg.NKV, cfg.I, cfg.name))


def units(cfg, tp=1):
    """[(name, numel)] in shardtrain's unit order: embedding, blocks, final norm (+ untied head).
    tp > 1: one TP rank's slice of each unit (what FSDP shards over the dp_shard ranks)."""
    check_tp(cfg, tp)
    Vt = cfg.vocab_rows(tp)
    u = [("model.embed_tokens", Vt * cfg.C)]
    u += [("model.layers.%d" % l, cfg.block_numel(tp)) for l in range(cfg.L)]
    u.append(("model.norm", cfg.C + (0 if cfg.tied else Vt * cfg.C)))
    return u


def shard_size(numel, world):
    """S = max(1, ceil(numel / W)) (ShardPlan::build)."""
    return max(1, -(-numel // world))


def flops_per_token(cfg, T):
    """train.h flops_per_token: 6 N + 12 L Q T (PaLM, Chowdhery et al. 2022, appendix B)."""
    return 6.0 * cfg.num_params() + 12.0 * cfg.L * cfg.Q * T


# --------------------------------------------------------------------------------------------
# What one micro-batch's forward + backward does, in program order (src/model/llama.cpp,
# llama_block.cpp, llama_head.cpp):
# each item = (label, unit gathered before its compute or None, real FLOPs per token of its
# compute, [units reduce-scattered after its compute]).

def step_items(cfg, T):
    C, V, L = cfg.C, cfg.V, cfg.L
    blk_w = cfg.block_numel()
    attn = 12.0 * cfg.Q * T  # per layer, forward + backward
    E, H = 0, L + 1
    items = [("embed fwd", E, 0.0, [])]
    for l in range(L):
        items.append(("block %d fwd" % l, 1 + l, 2.0 * blk_w + attn / 3, []))
    if cfg.tied:
        # gather(L+1) for the final norm; gather(0) again for the tied head; the head's forward and
        # backward; reduce-scatter 0; gather(L+1) again for the norm's backward; reduce-scatter L+1.
        items.append(("final norm fwd", H, 0.0, []))
        items.append(("tied head fwd+bwd", E, 6.0 * V * C, [E]))
        items.append(("final norm bwd", H, 0.0, [H]))
    else:
        items.append(("head fwd+bwd", H, 6.0 * V * C, [H]))
    for l in reversed(range(L)):
        items.append(("block %d bwd" % l, 1 + l, 4.0 * blk_w + 2 * attn / 3, [1 + l]))
    items.append(("embed bwd", None, 0.0, [E]))  # no gather: the lookup gradient needs no weights
    return items


def collective_counts(cfg):
    """Gathers and reduce-scatters per micro-batch, per unit index."""
    n = cfg.L + 2
    ag, rs = [0] * n, [0] * n
    for _, g, _, r in step_items(cfg, 1):
        if g is not None:
            ag[g] += 1
        for u in r:
            rs[u] += 1
    return ag, rs


# --------------------------------------------------------------------------------------------
# Tensor parallelism with sequence parallelism (issue 31): the collectives of a TP group of tp
# consecutive ranks, per micro-batch of B x T tokens (the whole group's micro-batch). Between the
# blocks the residual stream is split over the tp ranks along the sequence ([B*T/tp, C] each);
# each all-gather or reduce-scatter moves a full [B*T, C] buffer of F = B*T*C*e bytes (e the
# activation element size), (tp-1)/tp F per rank (ring). docs/scaling.md lists the calls. Once per
# optimizer step the replicated RMSNorm weights' gradients are summed over the group as well
# (tp_norm_allreduce). The C++ counts the same bytes in its per-step metric tp_bytes.

RECOMPUTE = ("none", "selective", "full")


def default_loss_chunk(V):
    """src/model/llama.cpp default_loss_chunk: max(256, 2^24 / V) tokens. Under TP it is called with
    the vocabulary rows of one TP rank, Vl = ceil(V / tp) (Config.vocab_rows(tp))."""
    return max(256, (1 << 24) // max(1, V))


def tp_item_calls(cfg, B, T, tp, elem_bytes, recompute="none", loss_chunk=None):
    """The TP collectives of one micro-batch, one list per item of step_items(cfg, T) (same order):
    (op, total bytes S of the call over the tp ranks, element bytes), op as comm_bandwidth names
    it (allgather, reduce_scatter, allreduce). tp = 1: none. The vocabulary-parallel cross-entropy,
    per loss chunk of n tokens (chunk = min(loss_chunk or default_loss_chunk(Vl), B T), Vl =
    ceil(V / tp)): one all-gather of the n fp32 row maxima (n floats from each rank: S = tp n 4)
    and one all-reduce (sum) of 2n fp32 (sum of exponentials, target logit: S = 2n 4). The
    replicated norms' per-step all-reduce is not here (tp_norm_allreduce)."""
    if recompute not in RECOMPUTE:
        raise ValueError("recompute must be one of %s, got %r" % (", ".join(RECOMPUTE), recompute))
    check_tp(cfg, tp)
    raw = step_items(cfg, T)
    if tp == 1:
        return [[] for _ in raw]
    e = elem_bytes
    F = B * T * cfg.C * e
    AG, RS = ("allgather", F, e), ("reduce_scatter", F, e)
    BT = B * T
    chunk = min(loss_chunk if loss_chunk else default_loss_chunk(cfg.vocab_rows(tp)), BT)
    ce = []
    for a in range(0, BT, chunk):  # per loss chunk of n tokens: fp32 row maxima, then sum of exp + target logit
        n = min(chunk, BT - a)
        ce += [("allgather", tp * n * 4, 4), ("allreduce", 2 * n * 4, 4)]
    out = []
    for label, _, _, _ in raw:
        if label == "embed fwd":
            c = [RS]                       # vocabulary-parallel lookup: partial rows, reduce-scattered
        elif label == "embed bwd":
            c = [AG]                       # the sequence-split output gradient, gathered
        elif label.startswith("block") and label.endswith("fwd"):
            c = [AG, RS, AG, RS]           # norm -> q/k/v, o_proj -> residual; norm -> gate/up, down -> residual
        elif label.startswith("block") and label.endswith("bwd"):
            c = [AG, RS, AG] if recompute == "full" else []  # the rerun forward stops before down_proj
            c += [AG, AG, RS, AG, AG, RS]  # mlp: dy for down, norm output for gate/up, RS dx; attn: the same
        elif "head" in label:
            c = [AG] + ce + [RS]           # final-norm output gathered; the loss; its input gradient
        else:
            c = []                         # tied model's final norm items: no TP collective
        out.append(c)
    return out


def tp_bytes_per_microbatch(cfg, B, T, tp, elem_bytes, recompute="none", loss_chunk=None):
    """Bytes each rank of a TP group sends in the TP collectives of one micro-batch of B x T tokens,
    ring algorithms: all-gather and reduce-scatter (tp-1)/tp S, all-reduce 2 (tp-1)/tp S. Per
    decoder layer (all-gathers + reduce-scatters) 10 (tp-1)/tp F, 13 with full recompute."""
    sums = {"allgather": 0, "reduce_scatter": 0, "allreduce": 0}
    calls = dict.fromkeys(sums, 0)
    for c in tp_item_calls(cfg, B, T, tp, elem_bytes, recompute, loss_chunk):
        for op, S, _ in c:
            sums[op] += S
            calls[op] += 1
    F = B * T * cfg.C * elem_bytes
    per_layer = (13 if recompute == "full" else 10) * F * (tp - 1) / tp
    return {"all_gather": sums["allgather"] * (tp - 1) / tp,
            "reduce_scatter": sums["reduce_scatter"] * (tp - 1) / tp,
            "all_reduce": 2 * sums["allreduce"] * (tp - 1) / tp,
            "calls": {"all_gather": calls["allgather"], "reduce_scatter": calls["reduce_scatter"],
                      "all_reduce": calls["allreduce"]},
            "F": F, "per_layer": per_layer if tp > 1 else 0.0}


def tp_norm_allreduce(cfg, tp, dp_shard=1):
    """The per-step sum of the replicated RMSNorm weights' gradients over the TP group
    (ShardedState::sum_replicated_grads, once per optimizer step after the last micro-batch): one
    fp32 all-reduce per replicated parameter range inside the rank's own FSDP shard of each unit.
    Returns (calls, bytes sent per rank, ring 2 (tp-1)/tp x count x 4). dp_shard = 1, exact: 2L + 1
    all-reduces of C floats (each layer's two norms, the final norm). dp_shard > 1: which ranges a
    rank's shard holds (and how many calls a range cut by a shard boundary makes) depends on where
    the boundaries fall; modelled as the dp_shard = 1 case divided evenly over the dp_shard ranks
    (calls and bytes / dp_shard, possibly fractional). tp = 1: (0, 0)."""
    check_tp(cfg, tp)
    if tp == 1:
        return 0, 0.0
    calls = 2 * cfg.L + 1
    nbytes = calls * 2 * (tp - 1) / tp * cfg.C * 4
    if dp_shard == 1:
        return calls, nbytes
    return calls / dp_shard, nbytes / dp_shard


def tp_bytes_per_step(cfg, B, T, tp, elem_bytes, micro_batches=1, recompute="none", loss_chunk=None, dp_shard=1):
    """What the C++ reports per optimizer step (metrics tp_bytes, tp_collectives): micro_batches x
    the micro-batch's TP bytes and calls (tp_bytes_per_microbatch) + the norms' all-reduce once
    (tp_norm_allreduce). Returns {"bytes", "calls"}."""
    b = tp_bytes_per_microbatch(cfg, B, T, tp, elem_bytes, recompute, loss_chunk)
    nc, nb = tp_norm_allreduce(cfg, tp, dp_shard)
    return {"bytes": micro_batches * (b["all_gather"] + b["reduce_scatter"] + b["all_reduce"]) + nb,
            "calls": micro_batches * sum(b["calls"].values()) + nc}


def recompute_flops(cfg, T):
    """Real FLOPs per token of one layer's forward rerun under --activation-checkpointing full
    (every GEMM but down_proj, and the attention), added to that layer's backward item."""
    return 2.0 * cfg.block_numel() + 12.0 * cfg.Q * T / 3 - 2.0 * cfg.C * cfg.I


# --------------------------------------------------------------------------------------------
# Precision and shardtrain's slabbing of reduce-scatters (shard.h / runtime.h).

K_REDUCE_SLAB = 1 << 22      # Fsdp::kReduceSlab and MixedPrecisionUnits::kWidenSlab (elements, all ranks)
K_COLLECTIVE_SLAB = 16 << 20  # Comm::kCollectiveSlab (bytes, all ranks): MPI Comm only


class Precision:
    """gather element bytes, reduce element bytes, and whether reduces are slabbed."""

    def __init__(self, name):
        self.name = name
        if name == "fp32":
            self.ag, self.rs, self.rs_slabbed = 4, 4, True
        elif name == "bf16":  # --precision bf16 (reduce in fp32, the default)
            self.ag, self.rs, self.rs_slabbed = 2, 4, True
        elif name == "bf16-rbf16":  # --precision bf16 --reduce-dtype bf16: one call, whole shard
            self.ag, self.rs, self.rs_slabbed = 2, 2, False
        elif name == "bf16-noslab":  # hypothetical: fp32 reduce in one call per unit (no 2^22 slabs)
            self.ag, self.rs, self.rs_slabbed = 2, 4, False
        else:
            raise ValueError("precision must be fp32, bf16, bf16-rbf16 or bf16-noslab, got %r" % name)


def rs_calls(S, max_S, world, prec):
    """Per-rank element counts of the reduce-scatter calls of one unit with shard size S."""
    if not prec.rs_slabbed:
        return [S]
    slab = min(max_S, max(1, K_REDUCE_SLAB // world))
    return [min(slab, S - a) for a in range(0, S, slab)]


def mpi_split(count, world, elem_bytes):
    """MpiComm's own slabs (CPU runs): at most kCollectiveSlab bytes over all ranks per call."""
    slab = max(1, K_COLLECTIVE_SLAB // elem_bytes // world)
    return [min(slab, count - a) for a in range(0, count, slab)] if count > slab else [count]


def bytes_per_step(cfg, world, prec, micro_batches=1, tp=1):
    """FSDP bytes each rank sends per optimizer step, ring algorithms: all-gather (n-1)/n x S x n x e,
    reduce-scatter the same (nccl-tests PERFORMANCE.md), n = W / tp dp_shard ranks, S the shard of
    a TP rank's slice of the unit (units(cfg, tp)). Returns (ag_bytes, rs_bytes). The TP
    collectives are tp_bytes_per_microbatch's."""
    if world % tp:
        raise ValueError("W = %d is not a multiple of tp = %d" % (world, tp))
    n = world // tp
    ag, rs = collective_counts(cfg)
    f = (n - 1) / n
    agb = rsb = 0.0
    for u, (_, numel) in enumerate(units(cfg, tp)):
        S = shard_size(numel, n)
        agb += ag[u] * f * S * n * prec.ag
        rsb += rs[u] * f * S * n * prec.rs
    return agb * micro_batches, rsb * micro_batches


# --------------------------------------------------------------------------------------------
# Fabrics and the cost of one collective.
#
# Ring all-gather / reduce-scatter over n ranks of S total bytes: (n-1) steps, each rank sends
# (n-1)/n S: t = (n-1) alpha + (n-1)/n S / B, B the bus bandwidth (nccl-tests' busbw).
# Ring all-reduce: t = 2 (n-1) alpha + 2 (n-1)/n S / B.

class Fabric:
    def __init__(self, name, nvlink_GBps, nic_Gbps, nics_per_node, alpha_intra_us, alpha_inter_us,
                 gpus_per_node=8, multi_ring=True):
        self.name = name
        self.B_intra = nvlink_GBps * 1e9
        self.B_nic = nic_Gbps / 8 * 1e9          # one NIC, one direction, bytes/s
        self.nics = nics_per_node
        self.a_intra = alpha_intra_us * 1e-6
        self.a_inter = alpha_inter_us * 1e-6
        self.g = gpus_per_node
        self.multi_ring = multi_ring

    def B_flat(self, tp=1):
        """Bus bandwidth of a ring over several nodes. NCCL runs one ring per NIC, each leaving a
        node once through its own NIC and crossing NVLink inside it: busbw = min(NVLink, NICs per
        node x NIC). multi_ring=False: one ring, bound by one NIC (the pessimistic reading).
        tp > 1: the tp dp_shard groups of a node (one per TP rank) run their collectives at the
        same time and share the node's NICs: min(NVLink, NICs x NIC / tp) each; with one ring per
        collective each group keeps its own NIC (its rail)."""
        if self.multi_ring:
            return min(self.B_intra, self.nics * self.B_nic / tp)
        return self.B_nic

    def B_rail(self):
        """Bandwidth per GPU when all g GPUs of a node talk across nodes at once (HSDP's
        all-reduce: one per local rank, each on its rail): NICs per node x NIC / g."""
        return self.nics * self.B_nic / self.g


def t_ring(n, total_bytes, B, alpha, calls=1, allreduce=False):
    if n <= 1:
        return 0.0
    k = 2 if allreduce else 1
    return calls * k * (n - 1) * alpha + k * (n - 1) / n * total_bytes / B


class Topology:
    """FSDP: shard over all W. HSDP: shard over the g GPUs of a node; gradient shards all-reduced
    across the R = W/g nodes. tp > 1: W = dp_replicate x dp_shard x tp with the tp ranks of a TP
    group consecutive (inside a node); FSDP shards each TP rank's slice over the dp_shard =
    G / tp ranks of its shard group (G = W for FSDP, g for HSDP: --shard-group-size counts ranks),
    which span G consecutive ranks, so they leave the node when G > g."""

    def __init__(self, fabric, world, mode, tp=1):
        self.f, self.W, self.mode, self.tp = fabric, world, mode, tp
        if mode == "hsdp" and world > fabric.g and world % fabric.g:
            raise ValueError("HSDP needs W a multiple of %d" % fabric.g)
        if world % tp or fabric.g % tp or (tp > 1 and min(world, fabric.g) % tp):
            raise ValueError("tp = %d must divide W = %d and the %d GPUs of a node" % (tp, world, fabric.g))

    def shard_world(self):
        return (min(self.W, self.f.g) if self.mode == "hsdp" else self.W) // self.tp

    def _link(self, n):
        f = self.f
        return (f.B_intra, f.a_intra) if n * self.tp <= f.g else (f.B_flat(self.tp), f.a_inter)

    def gather_time(self, numel, prec):
        n = self.shard_world()
        S = shard_size(numel, n)
        B, a = self._link(n)
        return t_ring(n, S * n * prec.ag, B, a)

    def reduce_time(self, numel, max_S, prec):
        n = self.shard_world()
        S = shard_size(numel, n)
        B, a = self._link(n)
        calls = rs_calls(S, max_S, n, prec)
        t = sum(t_ring(n, c * n * prec.rs, B, a) for c in calls)
        if self.mode == "hsdp" and self.W > n * self.tp:
            R = self.W // (n * self.tp)
            # fp32 (or bf16) all-reduce of this rank's gradient shard with its peers of the other
            # nodes, on its rail, once per slab: 2(R-1) alpha + 2(R-1)/R S e / B_rail.
            t += sum(t_ring(R, c * prec.rs, self.f.B_rail(), self.f.a_inter, allreduce=True) for c in calls)
        return t


# --------------------------------------------------------------------------------------------
# The overlap schedule.

def simulate(items, prefetch):
    """items: [(label, gather_seconds, compute_seconds, [reduce_seconds, ...])] in program order.
    Assumptions (docs/scaling.md): one communication stream, its collectives run one at a time in
    the order they are issued; the program issues gather k+d when compute k starts (prefetch d),
    gathers 0..d-1 at time 0, and each reduce-scatter right after its compute; compute k starts
    when compute k-1 has ended and gather k is complete. prefetch 0: no overlap (every collective
    blocks, compute and communication strictly alternate). The step ends when the last compute
    and the last reduce-scatter are done (the optimizer needs every gradient shard).
    Returns (step, compute, comm busy, exposed)."""
    compute = sum(c for _, _, c, _ in items)
    comm = sum(g + sum(r) for _, g, _, r in items)
    if prefetch <= 0:
        return compute + comm, compute, comm, comm
    n = len(items)
    free = 0.0            # when the communication stream is next idle
    done = [None] * n     # gather k complete

    def issue_gather(k, t):
        nonlocal free
        g = items[k][1]
        if g <= 0:
            done[k] = t
            return
        start = max(t, free)
        free = start + g
        done[k] = free

    for k in range(min(prefetch, n)):
        issue_gather(k, 0.0)
    end = 0.0
    for k in range(n):
        s = max(end, done[k])
        if k + prefetch < n:
            issue_gather(k + prefetch, s)
        end = s + items[k][2]
        for r in items[k][3]:
            start = max(end, free)
            free = start + r
    step = max(end, free)
    return step, compute, comm, step - compute


def model_items(cfg, T, tokens, topo, prec, t_compute, recompute="none", act_bytes=2, loss_chunk=None):
    """Items with seconds: compute t_compute split over items in proportion to their real FLOPs.
    With tp = topo.tp > 1 the FSDP collectives are those of a TP rank's slices (units(cfg, tp))
    over the dp_shard ranks, and each item's TP collectives (tp_item_calls for the group's
    micro-batch of tokens x tp tokens, on NVLink) are added to its compute: they block it.
    recompute full: each layer's backward item also reruns its forward (recompute_flops) at the
    same rate (t_compute is the time of the model FLOPs; the rerun costs in proportion)."""
    raw = step_items(cfg, T)
    real = sum(fl for _, _, fl, _ in raw)
    tp = topo.tp
    us = units(cfg, tp)
    n = topo.shard_world()
    max_S = max(shard_size(numel, n) for _, numel in us)
    extra = recompute_flops(cfg, T) if recompute == "full" else 0.0
    tpc = None
    if tp > 1:
        if (tokens * tp) % T:
            raise ValueError("tokens x tp = %d is not whole sequences of %d" % (tokens * tp, T))
        tpc = tp_item_calls(cfg, tokens * tp // T, T, tp, act_bytes, recompute, loss_chunk)
    f = topo.f
    out = []
    for k, (label, g, fl, rs) in enumerate(raw):
        tg = topo.gather_time(us[g][1], prec) if g is not None else 0.0
        tr = [topo.reduce_time(us[u][1], max_S, prec) for u in rs]
        if extra and label.startswith("block") and label.endswith("bwd"):
            fl = fl + extra
        tc = t_compute * fl / real
        if tpc:
            tc += sum(t_ring(tp, S, f.B_intra, f.a_intra, allreduce=(op == "allreduce")) for op, S, _ in tpc[k])
        out.append((label, tg, tc, tr))
    return out


def tp_norm_time(cfg, topo):
    """Seconds per step of the replicated norms' all-reduce over the TP group (tp_norm_allreduce with
    dp_shard = topo.shard_world(), on NVLink). It runs after the step's last reduce-scatter and
    blocks: run_point adds it to the end of the step."""
    if topo.tp == 1:
        return 0.0
    calls, nbytes = tp_norm_allreduce(cfg, topo.tp, topo.shard_world())
    S = nbytes / (2 * (topo.tp - 1) / topo.tp)  # the calls' total bytes
    return t_ring(topo.tp, S, topo.f.B_intra, topo.f.a_intra, calls=calls, allreduce=True)


def tp_time(cfg, tokens, T, topo, act_bytes=2, recompute="none", loss_chunk=None):
    """Seconds per step of the TP collectives on one GPU (exposed: they block the compute): the
    micro-batch's (tp_item_calls) and the norms' per-step all-reduce (tp_norm_time)."""
    if topo.tp == 1:
        return 0.0
    f = topo.f
    calls = tp_item_calls(cfg, tokens * topo.tp // T, T, topo.tp, act_bytes, recompute, loss_chunk)
    return sum(t_ring(topo.tp, S, f.B_intra, f.a_intra, allreduce=(op == "allreduce"))
               for c in calls for op, S, _ in c) + tp_norm_time(cfg, topo)


# --------------------------------------------------------------------------------------------
# Defaults and sources (docs/scaling.md lists the URLs).

PEAK_BF16 = 989e12       # H100/H200 SXM dense bf16 (the datasheets' 1,979 TFLOPS is with sparsity)
MFU_MEASURED = 0.253     # docs/benchmarks.md, GPU 2026-11-29: llama-350m bf16 on one H200, 720932f
MFU_TARGET = 0.45        # the issue's target
SEQ = 2048
TOKENS_PER_GPU = 8 * 2048  # one micro-batch of 8 x 2048 per GPU per optimizer step

FABRICS = {
    # NVLink 4: 900 GB/s per GPU total = 450 GB/s per direction; alpha per ring step assumed.
    "nvlink+ndr": Fabric("NVLink 4 + IB NDR 8x400 Gb/s", 450, 400, 8, 2.0, 5.0),
    "nvlink+100gbe": Fabric("NVLink 4 + 100 GbE 8x100 Gb/s", 450, 100, 8, 2.0, 10.0),
}
WORLDS = [8, 64, 256, 1024]


def run_point(cfg, fabric, world, mode, prefetch, prec, mfu, tokens=TOKENS_PER_GPU, T=SEQ, peak=PEAK_BF16,
              tp=1, act_bytes=2, recompute="none", loss_chunk=None):
    """One optimizer step of one micro-batch; tokens = tokens per GPU per step. tp > 1: a TP group
    of tp GPUs runs a micro-batch of tokens x tp tokens (tokens/s per GPU = the group's / tp);
    'compute' then holds the TP collectives ('tp'), 'exposed' is FSDP's alone. The norms' per-step
    TP all-reduce (tp_norm_time) follows the last reduce-scatter: it adds to the step and to
    'compute'."""
    t_compute = flops_per_token(cfg, T) * tokens / (mfu * peak)
    topo = Topology(fabric, world, mode, tp)
    items = model_items(cfg, T, tokens, topo, prec, t_compute, recompute, act_bytes, loss_chunk)
    step, comp, comm, exposed = simulate(items, prefetch)
    t_norm = tp_norm_time(cfg, topo)
    step, comp = step + t_norm, comp + t_norm
    r = {"step": step, "compute": comp, "comm": comm, "exposed": exposed, "tok_s": tokens / step}
    if tp > 1:
        r["tp"] = tp_time(cfg, tokens, T, topo, act_bytes, recompute, loss_chunk)
    else:
        r["tp"] = 0.0
    return r


STARTS_THRESHOLD = 0.05


def exposed_starts(cfg, fabric, mode, prefetch, prec, mfu, threshold=STARTS_THRESHOLD):
    """Smallest W (powers of two, 8 .. 4096) whose exposed communication exceeds threshold x compute."""
    W = 8
    while W <= 4096:
        r = run_point(cfg, fabric, W, mode, prefetch, prec, mfu)
        if r["exposed"] > threshold * r["compute"]:
            return W
        W *= 2
    return None


# --------------------------------------------------------------------------------------------
# Subcommands.

def cmd_plan(a):
    cfg = load_config(a.model)
    prec = Precision(a.precision)
    tp = a.tp
    n = a.world // tp
    print("%s: %d parameters (%s head), flops/token at T=%d: %.4g" %
          (cfg.name, cfg.num_params(), "tied" if cfg.tied else "untied", a.seq_len, flops_per_token(cfg, a.seq_len)))
    if tp > 1:
        print("tp %d: units are one TP rank's slice, sharded over dp_shard = W / tp = %d ranks" % (tp, n))
    ag, rs = collective_counts(cfg)
    print("%-20s %14s %14s %14s %8s %8s" % ("unit", "numel", "shard S", "padded S*W", "gathers", "reduces"))
    for u, (name, numel) in enumerate(units(cfg, tp)):
        S = shard_size(numel, n)
        print("%-20s %14d %14d %14d %8d %8d" % (name, numel, S, S * n, ag[u], rs[u]))
    agb, rsb = bytes_per_step(cfg, a.world, prec, tp=tp)
    print("per micro-batch per rank (ring, (W-1)/W): all-gather %.4g GB (%d-byte elements), "
          "reduce-scatter %.4g GB (%d-byte)" % (agb / 1e9, prec.ag, rsb / 1e9, prec.rs))
    if tp > 1:
        b = tp_bytes_per_microbatch(cfg, a.micro_batch, a.seq_len, tp, prec.ag, a.recompute)
        print("TP per micro-batch of %d x %d per rank (ring, (tp-1)/tp; all-reduce 2(tp-1)/tp): F = %d bytes; "
              "all-gather %.4g GB in %d calls, reduce-scatter %.4g GB in %d, all-reduce %.4g MB in %d; "
              "per layer %.4g GB (recompute %s)" %
              (a.micro_batch, a.seq_len, b["F"], b["all_gather"] / 1e9, b["calls"]["all_gather"],
               b["reduce_scatter"] / 1e9, b["calls"]["reduce_scatter"], b["all_reduce"] / 1e6,
               b["calls"]["all_reduce"], b["per_layer"] / 1e9, a.recompute))
        nc, nb = tp_norm_allreduce(cfg, tp, n)
        print("TP per optimizer step: the replicated norms' gradient all-reduce, %.4g calls, %.4g MB per rank "
              "(%s)" % (nc, nb / 1e6, "exact: 2L + 1 of C fp32" if n == 1 else
                        "2L + 1 of C fp32 divided evenly over dp_shard = %d, modelled" % n))


def fmt_ms(x):
    return "%.1f" % (x * 1e3)


def tables(markdown, mfus=(MFU_MEASURED, MFU_TARGET), out=sys.stdout):
    p = lambda s="": print(s, file=out)
    for mname in ("llama-1b", "llama-8b"):
        cfg = load_config(mname)
        fl = flops_per_token(cfg, SEQ)
        p("### %s (%s parameters, %s head)" % (mname, format(cfg.num_params(), ","), "tied" if cfg.tied else "untied"))
        p()
        for mfu in mfus:
            tc = fl * TOKENS_PER_GPU / (mfu * PEAK_BF16)
            p("MFU %.1f%%: compute %.0f ms per step, %.0f tokens/s per GPU without communication." %
              (100 * mfu, tc * 1e3, TOKENS_PER_GPU / tc))
        p()
        for pname in ("bf16", "bf16-rbf16"):
            prec = Precision(pname)
            for fkey, fab in FABRICS.items():
                p("**%s, %s** (%s). Cells: exposed communication ms per step / tokens/s per GPU; "
                  "first at MFU %.1f%%, then %.0f%%." %
                  (mname, {"bf16": "bf16 gather, fp32 reduce", "bf16-rbf16": "bf16 gather, bf16 reduce"}[pname],
                   fab.name, 100 * mfus[0], 100 * mfus[1]))
                p()
                p("| W | comm busy ms (FSDP / HSDP) | FSDP prefetch 1 | FSDP prefetch 2 | HSDP prefetch 1 | HSDP prefetch 2 |")
                p("|---|---|---|---|---|---|")
                for W in WORLDS:
                    cells = []
                    busy = []
                    for mode in ("fsdp", "hsdp"):
                        busy.append(fmt_ms(run_point(cfg, fab, W, mode, 1, prec, mfus[0])["comm"]))
                        for d in (1, 2):
                            rs = [run_point(cfg, fab, W, mode, d, prec, m) for m in mfus]
                            cells.append(" ; ".join("%s / %s" % (fmt_ms(r["exposed"]), format(round(r["tok_s"]), ","))
                                                    for r in rs))
                    p("| %d | %s | %s |" % (W, " / ".join(busy), " | ".join(cells)))
                p()
                starts = []
                for mode in ("fsdp", "hsdp"):
                    for d in (1, 2):
                        for m in mfus:
                            w = exposed_starts(cfg, fab, mode, d, prec, m)
                            starts.append("%s p%d MFU %.0f%%: %s" % (mode.upper(), d, 100 * m,
                                                                   "W = %d" % w if w else "> 4096"))
                p("Exposed communication above %d%% of compute from: " % (100 * STARTS_THRESHOLD) + "; ".join(starts) + ".")
                p()
        p("**%s, slabs vs none** (FSDP, prefetch 1, %s, MFU %.1f%%): exposed ms / tokens/s per GPU." %
          (mname, FABRICS["nvlink+ndr"].name, 100 * mfus[0]))
        p()
        p("| W | fp32 reduce, 2^22-element slabs (today) | fp32 reduce, one call per unit | bf16 reduce (one call) |")
        p("|---|---|---|---|")
        for W in WORLDS:
            cells = []
            for pname in ("bf16", "bf16-noslab", "bf16-rbf16"):
                r = run_point(cfg, FABRICS["nvlink+ndr"], W, "fsdp", 1, Precision(pname), mfus[0])
                cells.append("%s / %s" % (fmt_ms(r["exposed"]), format(round(r["tok_s"]), ",")))
            p("| %d | %s |" % (W, " | ".join(cells)))
        p()
        one = Fabric("single ring", 450, 400, 8, 2.0, 5.0, multi_ring=False)
        p("**%s, one ring per collective** (FSDP bus bandwidth = one 400 Gb/s NIC, 50 GB/s, instead of "
          "8 NICs; bf16 reduce; MFU %.1f%%): exposed ms / tokens/s per GPU, prefetch 1 and 2." % (mname, 100 * mfus[0]))
        p()
        p("| W | prefetch 1 | prefetch 2 |")
        p("|---|---|---|")
        for W in WORLDS:
            rs = [run_point(cfg, one, W, "fsdp", d, Precision("bf16-rbf16"), mfus[0]) for d in (1, 2)]
            p("| %d | %s |" % (W, " | ".join("%s / %s" % (fmt_ms(r["exposed"]), format(round(r["tok_s"]), ",")) for r in rs)))
        p()


def cmd_tables(a):
    tables(a.markdown)


# ---- tp-tables ----------------------------------------------------------------------------

TP_WORLDS = [64, 256, 1024]
TP_SIZES = [1, 2, 4, 8]
TP_MODELS = (("llama-8b", "none"), ("llama-70b", "full"))  # the recompute that fits at tp 1 (--mode plan)


def state_bytes(cfg, world, tp=1):
    """Coarse per-GPU bytes of the fp32 parameter shard, its gradient and AdamW's two moments
    (16 B per shard element): FSDP x TP shards everything over W (each TP slice over W / tp)."""
    return 16 * sum(shard_size(n, world // tp) for _, n in units(cfg, tp))


def tp_row(cfg, fab, W, prec, mfu, prefetch=1, tokens=None, recompute=None):
    """run_point for each TP size; tokens / recompute: a value or a function of tp."""
    out = []
    for tp in TP_SIZES:
        tk = tokens(tp) if callable(tokens) else (tokens or TOKENS_PER_GPU)
        rc = recompute(tp) if callable(recompute) else (recompute or "none")
        out.append(run_point(cfg, fab, W, "fsdp", prefetch, prec, mfu, tokens=tk, tp=tp, recompute=rc))
    return out


def tp_verdict(rows):
    """'W = 64: tp 1; W = 1024: tp 4 (+209% over tp 1)' from {W: [run_point per TP size]}."""
    parts = []
    for W, rs in rows.items():
        best = max(range(len(rs)), key=lambda i: rs[i]["tok_s"])
        gain = rs[best]["tok_s"] / rs[0]["tok_s"] - 1
        if best == 0:
            second = max(range(1, len(rs)), key=lambda i: rs[i]["tok_s"])
            parts.append("W = %d: tp 1 (best TP, tp %d, %.0f%% slower)" %
                         (W, TP_SIZES[second], 100 * (1 - rs[second]["tok_s"] / rs[0]["tok_s"])))
        else:
            parts.append("W = %d: tp %d (%+.0f%% over tp 1)" % (W, TP_SIZES[best], 100 * gain))
    return "; ".join(parts)


def tp_tables(markdown=True, out=sys.stdout):
    """Predicted tokens/s per GPU with TP + SP (docs/scaling.md, "Tensor parallelism (issue 31)")."""
    p = lambda s="": print(s, file=out)
    fab = FABRICS["nvlink+ndr"]
    variants = [
        ("bf16 gather, fp32 reduce in one call per unit (the NCCL lane today)", Precision("bf16-noslab")),
        ("bf16 gather, fp32 reduce in 2^22-element slabs (the host lane; the FSDP tables' 'today')", Precision("bf16")),
    ]
    for mname, rc in TP_MODELS:
        cfg = load_config(mname)
        p("#### %s with TP (%s parameters, --activation-checkpointing %s)" % (mname, format(cfg.num_params(), ","), rc))
        p()
        p("Largest TP-local unit (%s) gathered in bf16, per GPU: %s GB at tp %s; "
          "params + grads + AdamW (16 B per shard element) per GPU: %s GB at W = %s (any tp)." %
          ("embedding / head" if cfg.V * cfg.C > cfg.block_numel() else "a layer",
           " / ".join("%.2f" % (2 * max(n for _, n in units(cfg, tp)) / 1e9) for tp in TP_SIZES),
           " / ".join(str(tp) for tp in TP_SIZES),
           " / ".join("%.1f" % (state_bytes(cfg, W) / 1e9) for W in TP_WORLDS),
           " / ".join(str(W) for W in TP_WORLDS)))
        p()
        for vname, prec in variants:
            for mfu in (MFU_MEASURED, MFU_TARGET):
                if prec.rs_slabbed and mfu != MFU_MEASURED:
                    continue
                p("**%s, %s**, MFU %.1f%%, %s tokens per GPU per step (TP group micro-batch 8·tp × %d), "
                  "prefetch 1, %s. Cells: tokens/s per GPU (TP ms / FSDP exposed ms per step); "
                  "the best per row in bold." % (mname, vname, 100 * mfu, format(TOKENS_PER_GPU, ","), SEQ, fab.name))
                p()
                p("| W | " + " | ".join("tp %d" % tp for tp in TP_SIZES) + " |")
                p("|---|" + "---|" * len(TP_SIZES))
                rows = {}
                for W in TP_WORLDS:
                    rs = tp_row(cfg, fab, W, prec, mfu, recompute=rc)
                    rows[W] = rs
                    best = max(r["tok_s"] for r in rs)
                    cells = []
                    for r in rs:
                        c = format(round(r["tok_s"]), ",")
                        if r["tok_s"] == best:
                            c = "**%s**" % c
                        cells.append("%s (%s / %s)" % (c, fmt_ms(r["tp"]), fmt_ms(r["exposed"])))
                    p("| %d | %s |" % (W, " | ".join(cells)))
                p()
                p("Best: " + tp_verdict(rows) + ".")
                p()
        if mname == "llama-70b":
            # TP in place of recompute: the group keeps tp 1's micro-batch of 8 x 2048 (per-GPU
            # activations about 1/tp of tp 1's with SP), so tokens per GPU = 16,384 / tp.
            rcf = lambda tp: "full" if tp < 4 else "none"
            for mfu in (MFU_MEASURED, MFU_TARGET):
                p("**%s, TP in place of recompute**: TP group micro-batch 8 × %d (tokens per GPU per step "
                  "16,384 / tp), --activation-checkpointing full at tp 1 and 2, none at tp 4 and 8 "
                  "(coarse fit, see the text); bf16 gather, fp32 reduce in one call per unit, MFU %.1f%%, prefetch 1. "
                  "Cells as above." % (mname, SEQ, 100 * mfu))
                p()
                p("| W | " + " | ".join("tp %d (%s)" % (tp, rcf(tp)) for tp in TP_SIZES) + " |")
                p("|---|" + "---|" * len(TP_SIZES))
                rows = {}
                for W in TP_WORLDS:
                    rs = tp_row(cfg, fab, W, Precision("bf16-noslab"), mfu,
                                tokens=lambda tp: TOKENS_PER_GPU // tp, recompute=rcf)
                    rows[W] = rs
                    best = max(r["tok_s"] for r in rs)
                    p("| %d | %s |" % (W, " | ".join(
                        "%s (%s / %s)" % (("**%s**" if r["tok_s"] == best else "%s") % format(round(r["tok_s"]), ","),
                                          fmt_ms(r["tp"]), fmt_ms(r["exposed"])) for r in rs)))
                p()
                p("Best: " + tp_verdict(rows) + ".")
                p()


def cmd_tp_tables(a):
    tp_tables(a.markdown)


# ---- context parallelism (issue 41) -------------------------------------------------------

CP_METHODS = ("ring", "allgather")
K_CP_GATHER_BYTES = 256 << 20  # kCpGatherBytes (context_parallel.h): bound on AllGather's scratch


def cp_gather_kv_heads(cp, Tl, nh, nkv, HD, e, gather_bytes=K_CP_GATHER_BYTES):
    """KV heads per all-gather chunk (cp_gather_kv_heads in src/parallel/context_parallel.cpp): all
    nkv when their gathered K, V, dK, dV, 4 cp Tl nkv HD e bytes, fit gather_bytes; else as many as
    fit with the chunk's packed rows, (4 cp + 4 + 3 nh/nkv) Tl hk HD e, at least 1."""
    row_head = Tl * HD * e
    if 4 * cp * nkv * row_head <= gather_bytes:
        return nkv
    return int(max(1, min(nkv - 1, gather_bytes // ((4 * cp + 4 + 3 * (nh // nkv)) * row_head))))


def cp_bytes_per_layer(cfg, B, T, cp, method, e, doc=False, tp=1):
    """Bytes one rank sends in one decoder layer's context-parallel attention of one micro-batch of
    B sequences of T tokens (forward + backward), and the number of calls, as CpAttention counts
    them (metrics cp_bytes / cp_collectives; src/parallel/context_parallel.cpp). Tl = T / cp rows
    of each sequence per rank; K and V rows are KV/tp = NKV/tp x HD elements of e bytes (with TP,
    a rank holds NKV/tp KV heads); positions (and, with the document mask, document ids) travel
    with K/V as int32.
      ring: forward cp-1 shifts of K, V, positions (, ids); backward the same again plus cp
            shifts of the partial dK, dV (the last one delivers each rank its own keys' sums).
      allgather: per sequence an all-gather of positions (, ids), per chunk of KV heads an
            all-gather of K and V, forward and again in the backward, plus the backward's
            reduce-scatter of dK and dV: (cp-1) x a rank's part each (ring collectives)."""
    if method not in CP_METHODS:
        raise ValueError("method must be ring or allgather, got %r" % method)
    check_tp(cfg, tp)
    if cp < 1 or T % (2 * cp):
        raise ValueError("T = %d must divide by 2 x cp = %d" % (T, 2 * cp))
    Tl, KV = T // cp, cfg.KV // tp
    nid = 2 if doc else 1
    kv = B * Tl * KV * e          # one of K or V, this rank's rows
    ids = B * Tl * 4 * nid        # positions (+ document ids)
    out = {"Tl": Tl, "kv_block": kv}
    if cp == 1:
        out.update(forward=0.0, backward=0.0, bytes=0.0, calls=0)
        return out
    if method == "ring":
        fwd = (cp - 1) * (2 * kv + ids)
        bwd = (cp - 1) * (2 * kv + ids) + cp * 2 * kv
        calls = (cp - 1) * (2 + nid) * 2 + 2 * cp
    else:
        chunks = -(-(cfg.NKV // tp) // cp_gather_kv_heads(cp, Tl, cfg.NH // tp, cfg.NKV // tp, cfg.HD, e))
        fwd = (cp - 1) * (2 * kv + ids)
        bwd = (cp - 1) * (2 * kv + ids) + (cp - 1) * 2 * kv
        calls = 2 * B * (nid + 2 * chunks) + 2 * B * chunks
        out["chunks"] = chunks
    out.update(forward=float(fwd), backward=float(bwd), bytes=float(fwd + bwd), calls=calls)
    return out


def cp_bytes_per_step(cfg, B, T, cp, method, e, doc=False, tp=1, micro_batches=1):
    """cp_bytes and cp_collectives of one optimizer step (every decoder layer, every micro-batch;
    --activation-checkpointing none: a rerun forward would add its forward part again, not modelled)."""
    b = cp_bytes_per_layer(cfg, B, T, cp, method, e, doc, tp)
    return {"bytes": micro_batches * cfg.L * b["bytes"], "calls": micro_batches * cfg.L * b["calls"]}


def cp_layer_time(cfg, B, T, cp, method, mfu, B_link, alpha, e=2, doc=False, peak=PEAK_BF16):
    """One decoder layer of one micro-batch on one rank of a CP group over one NVLink domain:
    compute (PaLM FLOPs at `mfu` of `peak`: GEMMs 2 P_layer and attention 4 Q T per token forward,
    twice that backward, for the B T / cp tokens the rank holds; the head-tail split gives each
    rank, and each ring step, the same attention work) and the CP communication left exposed.
      ring: each of the cp-1 forward steps sends one K/V block (alpha + bytes / B_link, a point-
            to-point shift) while the step's block attention (1/cp of the rank's attention) runs;
            exposed = the part longer than that compute. Backward: K/V and the previous step's
            dK/dV in flight during each step's compute, the last dK/dV shift after the last step,
            exposed whole.
      allgather: blocking collectives (CpAttention's Transfers has no progress registry there):
            all of their ring time t_ring(cp, ...) is exposed.
    Returns dict(compute_s, attn_s, exposed_s, busy_s)."""
    Tl, KV, Q = T // cp, cfg.KV, cfg.Q
    tok = B * Tl
    rate = mfu * peak
    attn_f = 4.0 * Q * T * tok / rate
    gemm_f = 2.0 * cfg.block_numel() * tok / rate
    compute = 3 * (attn_f + gemm_f)
    nid = 2 if doc else 1
    kv, ids = B * Tl * KV * e, B * Tl * 4 * nid
    if cp == 1:
        return dict(compute_s=compute, attn_s=3 * attn_f, exposed_s=0.0, busy_s=0.0)
    if method == "ring":
        t_kv = alpha + (2 * kv + ids) / B_link
        t_g = alpha + 2 * kv / B_link
        step_f, step_b = attn_f / cp, 2 * attn_f / cp
        exposed = (cp - 1) * max(0.0, t_kv - step_f) + (cp - 1) * max(0.0, t_kv + t_g - step_b) + t_g
        busy = 2 * (cp - 1) * t_kv + cp * t_g
    else:
        chunks = -(-cfg.NKV // cp_gather_kv_heads(cp, Tl, cfg.NH, cfg.NKV, cfg.HD, e))
        ag = t_ring(cp, cp * (2 * kv + ids), B_link, alpha, calls=B * (nid + 2 * chunks))
        rs = t_ring(cp, cp * 2 * kv, B_link, alpha, calls=2 * B * chunks)
        exposed = busy = 2 * ag + rs
    return dict(compute_s=compute, attn_s=3 * attn_f, exposed_s=exposed, busy_s=busy)


def cp_ring_min_rows(cfg, mfu, B_link, e=2, peak=PEAK_BF16):
    """Rows per rank Tl above which a ring step's K/V transfer (2 Tl KV e bytes, alpha left out)
    takes less than the step's block attention (4 Q Tl^2 FLOPs forward): Tl >= KV e mfu peak /
    (2 Q B_link). The backward's ratio is the same (twice the bytes, twice the FLOPs)."""
    return cfg.KV * e * mfu * peak / (2.0 * cfg.Q * B_link)


CP_SEQS = (32768, 131072)
CP_SIZES = (2, 4, 8)


def cp_tables(markdown=True, out=sys.stdout, model="llama-8b", mfus=(MFU_MEASURED, MFU_TARGET)):
    cfg = load_config(model)
    f = FABRICS["nvlink+ndr"]
    B_link, alpha = f.B_intra, f.a_intra
    w = out.write
    w("**%s, bf16 (e = 2), one sequence per CP group (B = 1), CP inside one node (NVLink 4: %.0f GB/s per "
      "direction, alpha %.0f us), --activation-checkpointing none.** Bytes: what one rank sends per layer "
      "per step (forward + backward, causal; `document` adds 4 B per token and step for the ids). "
      "Cells of the time columns: CP exposed ms per step (all %d layers) / share of the step's compute, at MFU "
      "%.1f%% then %.0f%%.\n\n" % (model, B_link / 1e9, alpha * 1e6, cfg.L, 100 * mfus[0], 100 * mfus[1]))
    w("| T | cp | rows per rank | MB per layer, ring / allgather | compute per step, s (MFU %.1f%%) | ring exposed | allgather exposed | better |\n"
      % (100 * mfus[0]))
    w("|---|---|---|---|---|---|---|---|\n")
    for T in CP_SEQS:
        for cp in CP_SIZES:
            r = cp_bytes_per_layer(cfg, 1, T, cp, "ring", 2)
            g = cp_bytes_per_layer(cfg, 1, T, cp, "allgather", 2)
            cells, best = {}, None
            for m in CP_METHODS:
                parts = []
                for mfu in mfus:
                    t = cp_layer_time(cfg, 1, T, cp, m, mfu, B_link, alpha)
                    parts.append("%.1f / %.2f%%" % (1e3 * cfg.L * t["exposed_s"], 100 * t["exposed_s"] / t["compute_s"]))
                cells[m] = " ; ".join(parts)
            t0 = cp_layer_time(cfg, 1, T, cp, "ring", mfus[0], B_link, alpha)
            er = cp_layer_time(cfg, 1, T, cp, "ring", mfus[1], B_link, alpha)["exposed_s"]
            eg = cp_layer_time(cfg, 1, T, cp, "allgather", mfus[1], B_link, alpha)["exposed_s"]
            best = "ring" if er < eg else "allgather"
            w("| %s | %d | %s | %.0f / %.0f | %.2f | %s | %s | %s |\n" % (
                "{:,}".format(T), cp, "{:,}".format(T // cp), r["bytes"] / 1e6, g["bytes"] / 1e6,
                cfg.L * t0["compute_s"], cells["ring"], cells["allgather"], best))
    w("\nRing hides its K/V transfers when a rank holds at least %.0f rows (MFU %.1f%%) / %.0f (%.0f%%) "
      "(`cp_ring_min_rows`, alpha left out).\n" % (cp_ring_min_rows(cfg, mfus[0], B_link), 100 * mfus[0],
                                                  cp_ring_min_rows(cfg, mfus[1], B_link), 100 * mfus[1]))


def cmd_cp_tables(a):
    cp_tables(a.markdown, model=a.model)


def cmd_cp_bytes(a, out=sys.stdout):
    cfg = load_config(a.model)
    for m in ([a.method] if a.method else CP_METHODS):
        s = cp_bytes_per_step(cfg, a.micro_batch, a.seq_len, a.cp, m, 2 if a.act_dtype == "bf16" else 4,
                              a.mask == "document", a.tp, a.accum)
        out.write("%s cp %d, T %d, B %d, %s, %s: cp_bytes %.0f per step, cp_collectives %d\n" % (
            m, a.cp, a.seq_len, a.micro_batch, a.act_dtype, a.mask, s["bytes"], s["calls"]))


# ---- pipeline parallelism (issue 42, item 8) ------------------------------------------------
#
# A mesh point: W = pp x dp x tp (x cp) GPUs, pp outermost (each stage W / pp consecutive ranks,
# whole nodes when W / pp >= 8), TP inside a node, FSDP inside each stage over its dp = W / (pp tp
# cp) ranks of one TP index. m micro-batches of b sequences per pipeline per step: m = global
# sequences / (dp b). docs/scaling.md, "Pipeline parallelism (issue 42)", states every assumption.

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
GLOBAL_TOKENS = 16 * 2 ** 20   # Llama 3's 405B batch: 16M tokens (Dubey et al. 2024, table 4)
PP_SEQ = 8192
PP_WORLDS = [256, 512, 1024, 2048, 4096]
PP_WORLDS_405B = [8192, 16384]  # Llama 3's meshes (table 4), for llama-405b only
HBM_BYTES = 80e9               # H100 SXM 80 GB (the Llama 3 and torchtitan runs: H100)
HBM_RESERVE = 4e9              # CUDA context, allocator slack: assumed


def pp_bubble_time(schedule, P, tf, ti, tw, v=1):
    """Idle time of the slowest stage per step, tf / ti / tw its forward, input-gradient and
    weight-gradient time per micro-batch (tb = ti + tw), all its chunks together:
      gpipe, 1f1b   (P-1)(tf + tb)       (Huang et al. 2019, GPipe, section 2.2; Narayanan et al.
                                          2021, section 2.2.1: PipeDream-Flush has GPipe's bubble)
      interleaved   (P-1)(tf + tb) / v   (Narayanan et al. 2021, section 2.2.2)
      zb-h1         (P-1)(tf + ti - tw)  (Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024,
                                          section 3.1)"""
    if schedule not in PP_SCHEDULES:
        raise ValueError("schedule must be one of %s, got %r" % (", ".join(PP_SCHEDULES), schedule))
    if schedule == "interleaved":
        return (P - 1) * (tf + ti + tw) / v
    if schedule == "zb-h1":
        return (P - 1) * max(0.0, tf + ti - tw)
    return (P - 1) * (tf + ti + tw)


def pp_bubble_fraction(schedule, P, m, v=1, tf=1.0, ti=1.0, tw=1.0):
    """Bubble / step of a pipeline of m micro-batches, step = m (tf + tb) + bubble: (P-1)/(m+P-1)
    for gpipe and 1f1b, ((P-1)/v) / (m + (P-1)/v) interleaved, (P-1)(tf+ti-tw) / (m (tf+tb) +
    (P-1)(tf+ti-tw)) zb-h1 (with ti = tw = tf: (P-1) / (3m + P-1))."""
    bub = pp_bubble_time(schedule, P, tf, ti, tw, v)
    return bub / (m * (tf + ti + tw) + bub)


def pp_chunks(cfg, P, v=1):
    """Blocks 0..L+1 (0 the embedding, l+1 decoder layer l, L+1 the final norm and head) cut into
    S = P v contiguous chunks, the embedding and the head counted as one block each (docs/parallelism.md,
    "Pipeline parallelism"; include/shardtrain/parallel/pipeline_schedule.h); the first n mod S chunks take
    one block more (assumed: an uneven split's order is not modelled). Chunk c runs on pipeline
    rank c mod P. Returns [[block, ...] per chunk]."""
    n, S = cfg.L + 2, P * v
    if S > n:
        raise ValueError("%d chunks for %d blocks" % (S, n))
    out, a = [], 0
    for c in range(S):
        k = n // S + (1 if c < n % S else 0)
        out.append(list(range(a, a + k)))
        a += k
    return out


def _item_block(cfg, label):
    if label.startswith("embed"):
        return 0
    if label.startswith("block"):
        return 1 + int(label.split()[1])
    return cfg.L + 1  # final norm, head


def pp_stage_times(cfg, T, b, tp, topo, prec, mfu, recompute="none", act_bytes=2, peak=PEAK_BF16, P=1, v=1):
    """Per pipeline rank, per micro-batch of b sequences (the TP group's): forward, input-gradient
    and weight-gradient seconds of all its chunks, and per block its forward / backward seconds.
    The items and their seconds are model_items' (compute spread by real FLOPs from
    flops_per_token at `mfu`, TP collectives blocking on NVLink, full recompute in the backward);
    the head item (forward + backward) split 1/3 : 2/3 by its FLOPs (2VC : 4VC per token). tw is
    the weight-gradient GEMMs' share of the compute, 2 P_layer per token of a layer's 4 P_layer +
    8 Q T backward (2VC of the head's 4VC); ti = tb - tw (with them the recompute and the TP
    collectives)."""
    tokens = b * T // tp
    t_compute = flops_per_token(cfg, T) * tokens / (mfu * peak)
    items = model_items(cfg, T, tokens, topo, prec, t_compute, recompute, act_bytes)
    raw = step_items(cfg, T)
    real = sum(fl for _, _, fl, _ in raw)
    fwd = [0.0] * (cfg.L + 2)
    bwd = [0.0] * (cfg.L + 2)
    wgt = [0.0] * (cfg.L + 2)
    for label, _, tc, _ in items:
        k = _item_block(cfg, label)
        if "fwd+bwd" in label:
            fwd[k] += tc / 3
            bwd[k] += 2 * tc / 3
            wgt[k] += t_compute * 2.0 * cfg.V * cfg.C / real
        elif label.endswith("fwd"):
            fwd[k] += tc
        else:
            bwd[k] += tc
            if label.startswith("block"):
                wgt[k] += t_compute * 2.0 * cfg.block_numel() / real
    chunks = pp_chunks(cfg, P, v)
    ranks = []
    for r in range(P):
        blocks = [k for c in range(r, P * v, P) for k in chunks[c]]
        tf = sum(fwd[k] for k in blocks)
        tw = sum(wgt[k] for k in blocks)
        ranks.append({"blocks": blocks, "tf": tf, "tw": tw, "ti": sum(bwd[k] for k in blocks) - tw})
    return ranks, fwd, bwd


def pp_p2p_bytes(b, T, C, tp, cp=1, e=2):
    """Bytes one GPU sends per micro-batch per stage boundary, each direction: its sequence shard
    of the [b T, C] activations (forward) or their gradients (backward), b T / (tp cp) x C x e
    (with TP's sequence parallelism and CP each rank holds 1 / (tp cp) of the rows)."""
    return b * T * C * e / (tp * cp)


def pp_memory(cfg, W, P, tp, b, T, schedule, v, m, recompute):
    """Coarse bytes per GPU of the most loaded pipeline rank (rank 0): the sharded state, 16 B per
    element of the stage's TP slices over dp (fp32 parameter, gradient, AdamW m and v); gather and
    gradient buffers of the largest unit (2 + 4 B per element, twice: prefetch); activations kept,
    per layer and micro-batch with sequence parallelism (Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models", section 4): none b T C (34 / tp) bytes
    (their selective figure: a fused attention keeps no T x T scores), full 2 b T C / tp (the layer
    input); times the micro-batch-layers rank 0 holds: no PP, L (one micro-batch; accumulation
    frees each); gpipe min(m,..) m x L/P; 1f1b and zb-h1 min(P, m) x L/P (Qi et al. 2024: ZB-H1
    keeps 1F1B's peak); interleaved ((P-1) 2 + (v-1) P + 1) chunks of L/(P v) (Megatron-LM's
    warm-up count, include/shardtrain/parallel/pipeline_schedule.h, + the one in its backward)."""
    dp = W // (P * tp)
    chunks = pp_chunks(cfg, P, v)
    us = units(cfg, tp)
    blocks0 = [k for c in range(0, P * v, P) for k in chunks[c]]
    state = 16 * sum(shard_size(us[k][1], dp) for k in blocks0)
    bufs = 2 * 6 * max(n for _, n in us)
    per_layer = b * T * cfg.C * ((34.0 / tp) if recompute == "none" else (2.0 / tp))
    Ls = cfg.L / P
    if P == 1:
        held = cfg.L
    elif schedule == "gpipe":
        held = m * Ls
    elif schedule == "interleaved":
        held = min(m * v, (P - 1) * 2 + (v - 1) * P + 1) * cfg.L / (P * v)
    else:
        held = min(P, m) * Ls
    return state + bufs + held * per_layer


def pp_point(cfg, fabric, world, pp, tp, schedule="1f1b", v=1, micro_batch=1, global_tokens=GLOBAL_TOKENS,
             T=PP_SEQ, mfu=MFU_TARGET, prec=None, recompute="none", act_bytes=2, prefetch=1, peak=PEAK_BF16, cp=1):
    """Tokens/s per GPU of one mesh point (W = pp x dp x tp, cp = 1 in the time model).
    pp 1: FSDP x TP with m = global sequences / (dp b) accumulated micro-batches, each run_point's
    step of b T / tp tokens per GPU (every unit gathered and reduced per micro-batch), the TP norms'
    all-reduce once: step = m (run_point step - t_norm) + t_norm; m = 1 is run_point exactly.
    pp > 1: step = m (tf + ti + tw) + pp_bubble_time (the slowest rank) + the stage-boundary
    transfers on the fill and drain paths, 2 (pp v' - 1) t_p2p (v' = v interleaved, else 1), + any
    part of a transfer longer than the action it overlaps (StageLink posts receives one action
    ahead: m v x [max(0, t_p2p - tf/v) + max(0, t_p2p - tb/v)]) + FSDP's exposed part, each unit
    of a stage gathered once per step and reduced once (shardtrain's default under PP): rank 0's
    gathers with its first forward and its reduce-scatters after its last backward (the step's
    first and last actions; the other ranks' hide in the fill and drain), simulate()'d with
    `prefetch` + the TP norms' all-reduce over 1/pp of the layers."""
    prec = prec or Precision("bf16-noslab")
    if cp != 1:
        raise ValueError("cp > 1 is not in the PP time model (pp_p2p_bytes takes cp)")
    if world % (pp * tp):
        raise ValueError("W = %d is not a multiple of pp x tp = %d" % (world, pp * tp))
    dp = world // (pp * tp)
    seqs = global_tokens // T
    if seqs % (dp * micro_batch):
        raise ValueError("%d sequences do not split into dp %d x micro-batch %d" % (seqs, dp, micro_batch))
    m = seqs // (dp * micro_batch)
    tok_gpu = global_tokens / world
    if pp == 1:
        r = run_point(cfg, fabric, world, "fsdp", prefetch, prec, mfu, tokens=micro_batch * T // tp, T=T,
                      peak=peak, tp=tp, act_bytes=act_bytes, recompute=recompute)
        t_norm = tp_norm_time(cfg, Topology(fabric, world, "fsdp", tp))
        step = m * (r["step"] - t_norm) + t_norm
        return {"step": step, "tok_s": tok_gpu / step, "m": m, "dp": dp, "bubble": 0.0,
                "pipeline": m * r["compute"], "fsdp": m * r["exposed"], "p2p": 0.0, "run_point": r}
    if schedule == "interleaved" and m % pp:
        raise ValueError("interleaved needs m = %d a multiple of pp = %d" % (m, pp))
    vv = v if schedule == "interleaved" else 1
    topo = Topology(fabric, world // pp, "fsdp", tp)
    ranks, fwd, bwd = pp_stage_times(cfg, T, micro_batch, tp, topo, prec, mfu, recompute, act_bytes, peak, pp, vv)
    slow = max(ranks, key=lambda x: x["tf"] + x["ti"] + x["tw"])
    tf, ti, tw = slow["tf"], slow["ti"], slow["tw"]
    bubble = pp_bubble_time(schedule, pp, tf, ti, tw, vv)
    pipeline = m * (tf + ti + tw) + bubble
    # Stage-boundary transfers: NICs (one per GPU, all in use at once) unless the whole pipeline
    # sits in one node.
    B, a = (fabric.B_nic, fabric.a_inter) if world > fabric.g else (fabric.B_intra, fabric.a_intra)
    t_p2p = a + pp_p2p_bytes(micro_batch, T, cfg.C, tp, cp, act_bytes) / B
    p2p = 2 * (pp * vv - 1) * t_p2p
    p2p += m * vv * (max(0.0, t_p2p - tf / vv) + max(0.0, t_p2p - (ti + tw) / vv))
    # FSDP on rank 0: each unit gathered once, with the first forward; reduced once after the last backward.
    us = units(cfg, tp)
    n = topo.shard_world()
    max_S = max(shard_size(k, n) for _, k in us)
    blocks0 = ranks[0]["blocks"]
    fitems = [(str(k), topo.gather_time(us[k][1], prec), fwd[k], []) for k in blocks0]
    bitems = [(str(k), 0.0, bwd[k], [topo.reduce_time(us[k][1], max_S, prec)]) for k in reversed(blocks0)]
    fsdp = simulate(fitems, prefetch)[3] + simulate(bitems, prefetch)[3]
    t_norm = tp_norm_time(cfg, topo) / pp
    step = pipeline + p2p + fsdp + t_norm
    return {"step": step, "tok_s": tok_gpu / step, "m": m, "dp": dp, "bubble": bubble / pipeline,
            "pipeline": pipeline, "fsdp": fsdp, "p2p": p2p, "t_p2p": t_p2p, "tf": tf, "ti": ti, "tw": tw}


PP_SIZES = (2, 4, 8, 16, 32)
PP_MICRO = (1, 2, 4, 8, 16)
PP_MODELS = ("llama-70b", "llama-405b")


def pp_fit_recompute(cfg, W, pp, tp, b, T, schedule, v, m, hbm=HBM_BYTES):
    """The cheapest --activation-checkpointing (none, else full) whose pp_memory fits hbm - reserve."""
    for rc in ("none", "full"):
        if pp_memory(cfg, W, pp, tp, b, T, schedule, v, m, rc) <= hbm - HBM_RESERVE:
            return rc
    return None


def pp_candidates(cfg, W, with_pp, schedules=("1f1b", "interleaved"), T=PP_SEQ, global_tokens=GLOBAL_TOKENS):
    """Mesh points (pp, tp, schedule, v, b, m): tp 1-8 dividing the heads, pp 1 or 2-32, b 1-16
    sequences, m whole, interleaved with v 2 and 4 and m a multiple of pp."""
    seqs = global_tokens // T
    for tp in (1, 2, 4, 8):
        try:
            check_tp(cfg, tp)
        except ValueError:
            continue
        for pp in (PP_SIZES if with_pp else (1,)):
            if W % (pp * tp):
                continue
            dp = W // (pp * tp)
            for b in PP_MICRO:
                if seqs % (dp * b):
                    continue
                m = seqs // (dp * b)
                for s in (schedules if pp > 1 else ("none",)):
                    for v in ((2, 4) if s == "interleaved" else (1,)):
                        if pp * v > cfg.L + 2 or (s == "interleaved" and m % pp):
                            continue
                        yield pp, tp, s, v, b, m


def pp_best(cfg, fabric, W, with_pp, mfu, schedules=("1f1b", "interleaved"), hbm=HBM_BYTES):
    """The mesh point of pp_candidates with the most tokens/s per GPU among those whose coarse
    memory (pp_memory) fits: (tokens/s, point dict) or (0, None)."""
    best = (0.0, None)
    for pp, tp, s, v, b, m in pp_candidates(cfg, W, with_pp, schedules):
        rc = pp_fit_recompute(cfg, W, pp, tp, b, PP_SEQ, s, v, m, hbm)
        if rc is None:
            continue
        r = pp_point(cfg, FABRICS["nvlink+ndr"], W, pp, tp, s if pp > 1 else "1f1b", v, b, mfu=mfu, recompute=rc)
        if r["tok_s"] > best[0]:
            r.update(pp=pp, tp=tp, schedule=s, v=v, b=b, recompute=rc)
            best = (r["tok_s"], r)
    return best


def _mesh(r):
    s = "tp %d" % r["tp"] + (" × pp %d" % r["pp"] if r["pp"] > 1 else "") + " × dp %d" % r["dp"]
    if r["pp"] > 1:
        s += ", %s%s" % (r["schedule"], " v %d" % r["v"] if r["schedule"] == "interleaved" else "")
    return s + ", b %d, m %d, %s" % (r["b"], r["m"], r["recompute"])


def pp_tables(out=sys.stdout, mfus=(MFU_TARGET, MFU_MEASURED)):
    """docs/scaling.md, "Pipeline parallelism (issue 42)": best mesh with and without PP."""
    p = lambda s="": print(s, file=out)
    fab = FABRICS["nvlink+ndr"]
    for mname in PP_MODELS:
        cfg = load_config(mname)
        for mfu in mfus:
            p("**%s, MFU %.1f%%**, seq %d, global batch %s tokens (%d sequences), %s, bf16 gather, fp32 "
              "reduce in one call per unit, prefetch 1, %d GB per GPU. Cells: tokens/s per GPU (mesh, micro-batch "
              "b sequences, m micro-batches per step, recompute); bubble = the pipeline's idle share; ZB-H1: "
              "the PP column's mesh under zb-h1." % (mname, 100 * mfu, PP_SEQ, format(GLOBAL_TOKENS, ","),
                                                    GLOBAL_TOKENS // PP_SEQ, fab.name, HBM_BYTES / 1e9))
            p()
            p("| W | best without PP (FSDP × TP) | best with PP (1f1b / interleaved) | bubble | PP / no PP | ZB-H1, same mesh |")
            p("|---|---|---|---|---|---|")
            for W in PP_WORLDS + (PP_WORLDS_405B if mname == "llama-405b" else []):
                t0, r0 = pp_best(cfg, fab, W, False, mfu)
                t1, r1 = pp_best(cfg, fab, W, True, mfu)
                c0 = "%s (%s)" % (format(round(t0), ","), _mesh(r0)) if r0 else "does not fit"
                c1 = "%s (%s)" % (format(round(t1), ","), _mesh(r1)) if r1 else "does not fit"
                zb = "-"
                if r1:
                    z = pp_point(cfg, fab, W, r1["pp"], r1["tp"], "zb-h1", 1, r1["b"], mfu=mfu, recompute=r1["recompute"])
                    zb = format(round(z["tok_s"]), ",")
                ratio = "%+.0f%%" % (100 * (t1 / t0 - 1)) if (r0 and r1) else "-"
                p("| %d | %s | %s | %s | %s | %s |" % (W, c0, c1, "%.1f%%" % (100 * r1["bubble"]) if r1 else "-", ratio, zb))
            p()


def mfu_to_match(fn, target, lo=0.05, hi=1.0):
    """The MFU at which fn(mfu) (tokens/s, increasing in mfu) equals target, by bisection; None above hi."""
    if fn(hi) < target:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fn(mid) < target else (lo, mid)
    return (lo + hi) / 2


# Published points: (label, model, W, pp, tp, global sequences, micro-batch, recompute, published tokens/s per GPU)
LLAMA3_POINTS = (  # Dubey et al. 2024, "The Llama 3 Herd of Models", table 4: TFLOPs/GPU 430 and 400
    ("Llama 3, 8,192 GPUs", "llama-405b", 8192, 16, 8, 2048, 1, 430e12),
    ("Llama 3, 16,384 GPUs", "llama-405b", 16384, 16, 8, 2048, 1, 400e12),
)
TORCHTITAN_POINTS = (  # pytorch/torchtitan docs/performance.md, table 5 (Liang et al. 2024, arXiv 2410.06511)
    ("1f1b", 1, 100.0),
    ("interleaved", 2, 128.0),
)


def pp_published(out=sys.stdout, mfus=(MFU_MEASURED, MFU_TARGET)):
    p = lambda s="": print(s, file=out)
    fab = FABRICS["nvlink+ndr"]
    cfg = load_config("llama-405b")
    fpt = flops_per_token(cfg, PP_SEQ)
    p("llama-405b flops per token at T = %d: %.4g (6N + 12 L Q T)." % (PP_SEQ, fpt))
    p()
    p("| point | mesh | schedule | m | bubble | published | predicted, MFU %.1f%% / %.0f%% | MFU the model needs to match |"
      % (100 * mfus[0], 100 * mfus[1]))
    p("|---|---|---|---|---|---|---|---|")
    for label, mname, W, pp, tp, seqs, b, tflops in LLAMA3_POINTS:
        for s, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("interleaved", 8), ("zb-h1", 1)):
            f = lambda mfu, s=s, v=v: pp_point(cfg, fab, W, pp, tp, s, v, b, seqs * PP_SEQ, mfu=mfu, recompute="none")
            rs = [f(mu) for mu in mfus]
            need = mfu_to_match(lambda mu: f(mu)["tok_s"], tflops / fpt)
            p("| %s | tp %d × pp %d × dp %d, b %d | %s | %d | %.1f%% | %.0f TFLOP/s (%s tokens/s) | %s | %s |" % (
                label, tp, pp, rs[0]["dp"], b, s + (" v %d" % v if s == "interleaved" else ""), rs[0]["m"],
                100 * rs[1]["bubble"], tflops / 1e12, format(round(tflops / fpt), ","),
                " / ".join("%s tokens/s = %.0f TFLOP/s" % (format(round(r["tok_s"]), ","), r["tok_s"] * fpt / 1e12) for r in rs),
                "%.1f%%" % (100 * need) if need else "> 100%"))
    for s, v, tok in TORCHTITAN_POINTS:
        f = lambda mfu, s=s, v=v: pp_point(cfg, fab, 512, 8, 8, s, v, 1, 256 * PP_SEQ, mfu=mfu, recompute="full")
        rs = [f(mu) for mu in mfus]
        need = mfu_to_match(lambda mu: f(mu)["tok_s"], tok)
        p("| torchtitan, 512 GPUs | tp 8 × pp 8 × dp 8, b 1 (assumed), full recompute | %s | %d | %.1f%% | %.0f tokens/s | %s | %s |" % (
            s + (" v %d (assumed)" % v if s == "interleaved" else ""), rs[0]["m"], 100 * rs[1]["bubble"], tok,
            " / ".join("%s tokens/s" % format(round(r["tok_s"]), ",") for r in rs),
            "%.1f%%" % (100 * need) if need else "> 100%"))


def cmd_pp_tables(a):
    pp_tables()
    pp_published()


# ---- expert parallelism (issue 56) --------------------------------------------------------
#
# docs/scaling.md, "Expert parallelism (issue 56)", states the design and every assumption.
# shardtrain's mesh is pp x dp_replicate x dp_shard x cp x tp; here dp_replicate = cp = 1, so
# W = pp x dp x tp, FSDP shards over the dp ranks of one TP index inside a stage, and --ep N adds
# no ranks: an EP group is N ranks of consecutive shard index of one shard group (N divides E and
# dp). Built: the dispatch (blocking all-to-alls), the experts' parameters still in their block's
# unit. Next: expert units of their own (the E / N experts of an EP rank, sharded over the dp / N
# ranks that hold the same experts). docs/moe.md says which is which.

MOE_PRESETS = {
    # name: (V, C, I, L, NH, NKV, tied, E, k, IE, shared expert width IS, leading dense layers,
    #        head_dim, qk_norm). The first three as src/model/config.cpp; the last is DeepSeek-V3's
    #        shape (deepseek-ai/DeepSeek-V3 inference/configs/config_671B.json) with standard
    #        multi-head attention in place of MLA (head_dim C / NH = 56), which shardtrain lacks.
    "tiny-moe": (258, 32, 64, 2, 4, 2, True, 8, 2, 64, 0, 0, None, False),
    "mixtral-8x7b": (32000, 4096, 14336, 32, 32, 8, False, 8, 2, 14336, 0, 0, None, False),
    "qwen3-30b-a3b": (151936, 2048, 6144, 48, 32, 4, False, 128, 8, 768, 0, 0, 128, True),
    "deepseek-v3-mha": (129280, 7168, 18432, 61, 128, 128, False, 256, 8, 2048, 2048, 3, None, False),
}
# DeepSeek-V3's MLA (config_671B.json): q_lora_rank, kv_lora_rank, qk_nope_head_dim,
# qk_rope_head_dim, v_head_dim; for the counts beside the approximation.
DSV3_MLA = (1536, 512, 128, 64, 128)


_MOE_COUNTS = {}  # parameter counts by (MoeConfig.key(), experts): the search asks for them often


class MoeConfig(Config):
    """A mixture-of-experts model as shardtrain counts it (src/model/config.cpp count_params): the
    first `dense_layers` layers have a SwiGLU MLP of width I, the others a router [E, C] (no bias),
    E routed experts of width IE (gate, up, down: 3 C IE each), k of them active per token, and,
    when IS > 0, a shared expert of width IS (DeepSeek's: always active and local, no all-to-all;
    shardtrain has none). Attention as the dense model's, + 2 HD with Qwen3's q/k norm."""

    def __init__(self, name, V, C, I, L, NH, NKV, tied, E, k, IE, IS=0, dense_layers=0, head_dim=None,
                 qk_norm=False):
        Config.__init__(self, name, V, C, I, L, NH, NKV, tied, head_dim)
        if not 1 <= k <= E:
            raise ValueError("top-k %d must be between 1 and the %d experts" % (k, E))
        self.E, self.k, self.IE, self.IS = E, k, IE, IS
        self.dense_layers, self.qk_norm = dense_layers, qk_norm

    def is_moe_layer(self, l):
        return l >= self.dense_layers

    def key(self):
        """Every field: what the model's numbers depend on."""
        return (self.name, self.V, self.C, self.I, self.L, self.NH, self.NKV, self.tied, self.HD, self.E, self.k,
                self.IE, self.IS, self.dense_layers, self.qk_norm)

    def attn_numel(self, tp=1):
        """Two RMSNorms [C], q, k, v, o (one TP rank's slices), q/k norms [HD] (replicated)."""
        C = self.C
        return 2 * C + C * self.Q // tp + 2 * C * self.KV // tp + self.Q // tp * C + (2 * self.HD if self.qk_norm else 0)

    def expert_numel(self, tp=1):
        """One routed expert's gate, up and down, 3 C IE; per TP rank 1/tp of it (each expert
        sliced as a dense MLP is: 'expert TP = TP')."""
        return 3 * self.C * self.IE // tp

    def nonexpert_numel(self, l, tp=1):
        """Layer l without its routed experts: attention + dense MLP, or router (replicated) +
        shared expert."""
        if not self.is_moe_layer(l):
            return self.attn_numel(tp) + 3 * self.C * self.I // tp
        return self.attn_numel(tp) + self.C * self.E + 3 * self.C * self.IS // tp

    def layer_numel(self, l, tp=1, experts=None):
        """Layer l with `experts` of its routed experts (default all E; k: what one token uses)."""
        n = self.nonexpert_numel(l, tp)
        if self.is_moe_layer(l):
            n += (self.E if experts is None else experts) * self.expert_numel(tp)
        return n

    def block_numel(self, tp=1):
        raise TypeError("%s: MoE layers differ; use layer_numel / nonexpert_numel / expert_numel" % self.name)

    def _count(self, experts):
        key = (self.key(), experts)
        if key not in _MOE_COUNTS:
            _MOE_COUNTS[key] = (self.V * self.C * (1 if self.tied else 2) + self.C +
                                sum(self.layer_numel(l, 1, experts) for l in range(self.L)))
        return _MOE_COUNTS[key]

    def num_params(self):
        return self._count(self.E)

    def num_active_params(self):
        return self._count(self.k)

    def dense_standin(self):
        """A dense Config with the same V, C, I, L, heads and tie: the TP collectives
        (tp_item_calls, tp_norm_time) depend on nothing else."""
        return Config(self.name, self.V, self.C, self.I, self.L, self.NH, self.NKV, self.tied, self.HD)


def load_moe_config(name):
    V, C, I, L, NH, NKV, tied, E, k, IE, IS, dense, hd, qkn = MOE_PRESETS[name]
    return MoeConfig(name, V, C, I, L, NH, NKV, tied, E, k, IE, IS, dense, hd, qkn)


def mla_attn_numel(C, NH, q_rank, kv_rank, nope, rope, v):
    """DeepSeek-V3's MLA per layer (deepseek-ai/DeepSeek-V3 inference/model.py, class MLA) + the
    block's two RMSNorms: wq_a [q_rank, C], q_norm [q_rank], wq_b [NH (nope + rope), q_rank],
    wkv_a [kv_rank + rope, C], kv_norm [kv_rank], wkv_b [NH (nope + v), kv_rank], wo [C, NH v]."""
    return (2 * C + C * q_rank + q_rank + q_rank * NH * (nope + rope) + C * (kv_rank + rope) + kv_rank +
            kv_rank * NH * (nope + v) + NH * v * C)


def dsv3_mla_counts(cfg):
    """(total, active) parameters of the same shape with DeepSeek's MLA in place of the MHA
    approximation and the gate's bias [E] per MoE layer (inference/model.py, Gate at dim 7168):
    DeepSeek-V3's main model (no MTP module) as its code builds it."""
    d = cfg.L * (mla_attn_numel(cfg.C, cfg.NH, *DSV3_MLA) - cfg.attn_numel()) + (cfg.L - cfg.dense_layers) * cfg.E
    return cfg.num_params() + d, cfg.num_active_params() + d


def dsv3_mla_attn_flops(cfg, T):
    """MLA's score and value FLOPs per token, forward + backward, all layers, counted as PaLM counts
    attention (12 L Q T, Q = the query width): 6 L NH (nope + rope + v) T."""
    _, _, nope, rope, v = DSV3_MLA
    return 6.0 * cfg.L * cfg.NH * (nope + rope + v) * T


def check_moe(cfg, tp=1, ep=1):
    """tp divides the heads, KV heads, I (check_tp), IE and IS; ep >= 1 divides E."""
    check_tp(cfg, tp)
    if cfg.IE % tp or cfg.IS % tp:
        raise ValueError("tp %d must divide the experts' width %d and the shared expert's %d of %s" %
                         (tp, cfg.IE, cfg.IS, cfg.name))
    if ep < 1 or cfg.E % ep:
        raise ValueError("ep %d must divide the %d experts of %s" % (ep, cfg.E, cfg.name))


def moe_flops_per_token(cfg, T):
    """6 N_active + 12 L Q T (shardtrain's MFU counts the active parameters, docs/moe.md; PaLM's
    attention term). As flops_per_token, the input embedding is counted."""
    return 6.0 * cfg.num_active_params() + 12.0 * cfg.L * cfg.Q * T


_MOE_UNITS = {}  # moe_units' results by (config, tp, ep, expert_units): the search asks for the same often


def moe_units(cfg, tp=1, ep=1, expert_units=True):
    """[(name, numel, kind)] per TP rank in shardtrain's unit order: embedding, layers, final norm
    (+ untied head), kind 'dense' (sharded over the dp ranks). expert_units (the next step): each
    MoE layer's routed experts leave the layer's unit for one of their own, listed after these,
    kind 'expert': an EP rank's E / ep experts (one TP rank's slices), sharded over the dp / ep
    ranks that hold the same experts. Without (what is built; and ep = 1, no EP): the layer's unit
    holds all E experts."""
    key = (cfg.key(), tp, ep, expert_units)
    if key in _MOE_UNITS:
        return _MOE_UNITS[key]
    check_moe(cfg, tp, ep)
    Vt = cfg.vocab_rows(tp)
    u = [("model.embed_tokens", Vt * cfg.C, "dense")]
    for l in range(cfg.L):
        u.append(("model.layers.%d" % l, cfg.nonexpert_numel(l, tp) if expert_units else cfg.layer_numel(l, tp), "dense"))
    u.append(("model.norm", cfg.C + (0 if cfg.tied else Vt * cfg.C), "dense"))
    if expert_units:
        for l in range(cfg.L):
            if cfg.is_moe_layer(l):
                u.append(("model.layers.%d.mlp.experts" % l, cfg.E // ep * cfg.expert_numel(tp), "expert"))
    _MOE_UNITS[key] = tuple(u)
    return _MOE_UNITS[key]


def expert_unit_index(cfg, l):
    """Index of MoE layer l's expert unit in moe_units(..., expert_units=True) (the MoE layers are
    the last L - dense_layers)."""
    if not cfg.is_moe_layer(l):
        raise ValueError("layer %d of %s is dense" % (l, cfg.name))
    return cfg.L + 2 + l - cfg.dense_layers


def ep_a2a_bytes(cfg, tokens, ep, e=2):
    """Bytes one rank sends in one all-to-all (dispatch, combine, or one of their backward
    transfers) with balanced routing: the k slots of its tokens (b T / tp rows under TP + SP), C
    elements of e bytes each, but the 1/ep that stay on the rank: tokens x k x C x e x (ep-1)/ep."""
    return tokens * cfg.k * cfg.C * e * (ep - 1) / ep


def ep_fsdp_bytes(cfg, dp, prec, tp=1, ep=1, expert_units=True):
    """FSDP bytes each rank sends per micro-batch (pp 1), ring (as bytes_per_step): per unit
    gathers x (n-1)/n x S n x e_g and reduce-scatters x (n-1)/n x S n x e_r, S = shard_size(numel,
    n); dense units over n = dp ranks, counted as collective_counts counts the dense model's
    (a layer gathered twice, reduced once); expert units over n = dp / ep, gathered twice, reduced
    once. Returns {"dense": (ag, rs), "expert": (ag, rs)}."""
    us = moe_units(cfg, tp, ep, expert_units)
    ag, rs = collective_counts(cfg.dense_standin())
    out = {"dense": [0.0, 0.0], "expert": [0.0, 0.0]}
    for u, (_, numel, kind) in enumerate(us):
        n = dp if kind == "dense" else dp // ep
        g, r = (ag[u], rs[u]) if kind == "dense" else (2, 1)
        S = shard_size(numel, n)
        out[kind][0] += g * (n - 1) / n * S * n * prec.ag
        out[kind][1] += r * (n - 1) / n * S * n * prec.rs
    return {k: tuple(v) for k, v in out.items()}


def ep_a2a_counts(recompute="none"):
    """Per MoE layer and micro-batch (src/model/llama_moe.cpp under --ep): (forward all-to-alls,
    backward input-gradient ones, backward weight-gradient ones, counts all-gathers). Forward 2
    (dispatch, combine); backward d(ye) dispatched and d(xe) combined, and the inputs sent again
    for the weight gradients (nothing of [rows, C] is kept); the counts (E int64) gathered once
    per forward. Full recompute reruns the forward: 2 all-to-alls and 1 all-gather more."""
    if recompute not in RECOMPUTE:
        raise ValueError("recompute must be one of %s, got %r" % (", ".join(RECOMPUTE), recompute))
    full = recompute == "full"
    return 2, 2 + (2 if full else 0), 1, 2 if full else 1


def ep_link(fabric, n, stride):
    """(bus bandwidth, alpha) of a ring over n ranks `stride` apart (dense units: stride tp;
    expert units: ep x tp): NVLink when the n x stride ranks lie in one node, else across nodes,
    where the min(stride, g) rings of a node that run at once share its NICs (Fabric.B_flat:
    each gets NICs x NIC / min(stride, g), at most NVLink's; one ring per collective: one NIC).
    With stride = tp this is Topology._link."""
    f = fabric
    if n * stride <= f.g:
        return f.B_intra, f.a_intra
    return f.B_flat(min(stride, f.g)), f.a_inter


def ep_a2a_time(fabric, ep, tp, send_bytes):
    """One all-to-all over an EP group of ep ranks `tp` apart, each holding send_bytes of rows of
    which (ep-1)/ep go to the others: pairwise exchange, (ep-1) alpha + bytes / B (Thakur et al.
    2005). Inside a node (ep x tp <= g): NVLink. Across nodes: the share for ranks of other nodes,
    (ep - g/tp)/ep, leaves through the GPU's part of its node's NICs (all GPUs exchange at once:
    NICs x NIC / g, Fabric.B_rail), the in-node share, (g/tp - 1)/ep, over NVLink meanwhile."""
    f = fabric
    if ep <= 1:
        return 0.0
    if ep * tp <= f.g:
        return (ep - 1) * f.a_intra + send_bytes * (ep - 1) / ep / f.B_intra
    local = f.g // tp
    return (ep - 1) * f.a_inter + max(send_bytes * (ep - local) / ep / f.B_rail(),
                                      send_bytes * (local - 1) / ep / f.B_intra)


def ep_counts_time(fabric, ep, tp, E):
    """The counts' all-gather, E int64 from each of the ep ranks (ring)."""
    if ep <= 1:
        return 0.0
    B, a = (fabric.B_intra, fabric.a_intra) if ep * tp <= fabric.g else (fabric.B_rail(), fabric.a_inter)
    return t_ring(ep, ep * E * 8, B, a)


_EP_RAW = {}  # _ep_raw's results by (config, T, expert_units, recompute)


def _ep_raw(cfg, T, expert_units, recompute):
    """ep_items' micro-batch without times: [(label, block, dir, unit gathered, model FLOPs per
    token, rerun FLOPs, weight-gradient FLOPs, [units reduced], layer, part, template key)], the
    model FLOPs of all items, and an MoE layer's FLOPs per direction {f, b} (what an overlapped
    all-to-all hides behind)."""
    key = (cfg.key(), T, expert_units, recompute)
    if key in _EP_RAW:
        return _EP_RAW[key]
    C, V = cfg.C, cfg.V
    attn = 4.0 * cfg.Q * T  # per token, forward (PaLM)
    full = recompute == "full"
    kinds = {}  # per layer kind (MoE or dense): parameters, the down projections
    for moe in (False, True):
        l = cfg.dense_layers if moe else 0
        if (moe and l >= cfg.L) or (not moe and cfg.dense_layers == 0):
            continue
        ne = cfg.nonexpert_numel(l)
        ex = cfg.layer_numel(l, 1, cfg.k) - ne
        kinds[moe] = (ne, ex, C * (cfg.IS if moe else cfg.I), cfg.k * C * cfg.IE if moe else 0)
    # (label, block, dir, unit gathered, model FLOPs, rerun FLOPs, weight-grad FLOPs, [units reduced], layer, part)
    raw = [("embed fwd", 0, "f", 0, 0.0, 0.0, 0.0, [], None, None)]
    for l in range(cfg.L):
        moe = cfg.is_moe_layer(l)
        ne, ex, _, _ = kinds[moe]
        if expert_units and moe:
            raw.append(("block %d fwd" % l, 1 + l, "f", 1 + l, 2.0 * ne + attn, 0.0, 0.0, [], l, "ne"))
            raw.append(("experts %d fwd" % l, 1 + l, "f", expert_unit_index(cfg, l), 2.0 * ex, 0.0, 0.0, [], l, "ex"))
        else:
            raw.append(("block %d fwd" % l, 1 + l, "f", 1 + l, 2.0 * (ne + ex) + attn, 0.0, 0.0, [], l, "all"))
    H = cfg.L + 1
    if cfg.tied:
        raw.append(("final norm fwd", H, "f", H, 0.0, 0.0, 0.0, [], None, None))
        raw.append(("tied head fwd+bwd", H, "fb", 0, 6.0 * V * C, 0.0, 2.0 * V * C, [0], None, None))
        raw.append(("final norm bwd", H, "b", H, 0.0, 0.0, 0.0, [H], None, None))
    else:
        raw.append(("head fwd+bwd", H, "fb", H, 6.0 * V * C, 0.0, 2.0 * V * C, [H], None, None))
    for l in reversed(range(cfg.L)):
        moe = cfg.is_moe_layer(l)
        ne, ex, down_ne, down_ex = kinds[moe]  # the rerun forward stops before the down projections
        if expert_units and moe:
            xu = expert_unit_index(cfg, l)
            raw.append(("experts %d bwd" % l, 1 + l, "b", xu, 4.0 * ex, 2.0 * (ex - down_ex) if full else 0.0,
                        2.0 * ex, [xu], l, "ex"))
            raw.append(("block %d bwd" % l, 1 + l, "b", 1 + l, 4.0 * ne + 2 * attn,
                        2.0 * (ne - down_ne) + attn if full else 0.0, 2.0 * ne, [1 + l], l, "ne"))
        else:
            raw.append(("block %d bwd" % l, 1 + l, "b", 1 + l, 4.0 * (ne + ex) + 2 * attn,
                        2.0 * (ne + ex - down_ne - down_ex) + attn if full else 0.0, 2.0 * (ne + ex), [1 + l], l, "all"))
    raw.append(("embed bwd", 0, "b", None, 0.0, 0.0, 0.0, [0], None, None))
    raw = [r + ((r[0], r[3], tuple(r[7])) if r[8] is None else (cfg.is_moe_layer(r[8]), r[2], r[9]),) for r in raw]
    cover = {"f": 0.0, "b": 0.0}
    for r in raw:
        if r[8] == cfg.dense_layers and cfg.is_moe_layer(r[8]):
            cover[r[2]] += r[4] + r[5]
    _EP_RAW[key] = (raw, sum(r[4] for r in raw), cover)
    return _EP_RAW[key]


def ep_items(cfg, T, b, tp, ep, dp, fabric, prec, mfu, recompute="none", act_bytes=2, expert_units=True,
             a2a_overlap=False, peak=PEAK_BF16):
    """One micro-batch of b sequences of T tokens (the TP group's: b T / tp tokens per GPU) on one
    GPU, in program order (step_items'; with expert units an MoE layer is two items: forward
    'block l' then 'experts l', backward 'experts l' then 'block l'). Each item a dict: label,
    block (0 embedding, 1 + l, L + 1 the head), dir ('f', 'b', 'fb' for the head's forward +
    backward), layer, g (its unit's all-gather, s), r ([reduce-scatters, s]), c (compute: the step's
    moe_flops_per_token at mfu spread over the items by their FLOPs; full recompute's rerun, less
    the down projections, added at the same rate), tw (the weight-gradient GEMMs' part of c), tp
    (TP collectives, blocking, NVLink; under EP an MoE layer's carry its slots, k F each), a2a
    (all-to-alls + counts, s), a2a_w (the re-sent inputs, the weight gradients' part), x (what of
    a2a is on the critical path: all of it blocking; with a2a_overlap what the same layer's
    compute of the same direction does not cover).
    FSDP: dense units over the dp ranks at stride tp, expert units over dp / ep at stride ep tp."""
    check_moe(cfg, tp, ep)
    if dp % ep:
        raise ValueError("ep %d must divide dp %d" % (ep, dp))
    us = moe_units(cfg, tp, ep, expert_units)
    n_of = {"dense": dp, "expert": dp // ep}
    link = {"dense": ep_link(fabric, dp, tp), "expert": ep_link(fabric, dp // ep, ep * tp)}
    max_S = max(shard_size(n, n_of[k]) for _, n, k in us) if prec.rs_slabbed else None
    memo = {}

    def gather(u):  # units of the same size and kind cost the same: computed once
        _, numel, kind = us[u]
        key = ("g", numel, kind)
        if key not in memo:
            n = n_of[kind]
            memo[key] = t_ring(n, shard_size(numel, n) * n * prec.ag, *link[kind])
        return memo[key]

    def reduce(u):
        _, numel, kind = us[u]
        key = ("r", numel, kind)
        if key not in memo:
            n = n_of[kind]
            memo[key] = sum(t_ring(n, c * n * prec.rs, *link[kind])
                            for c in rs_calls(shard_size(numel, n), max_S, n, prec))
        return memo[key]

    C, V = cfg.C, cfg.V
    full = recompute == "full"
    raw, model_fl, cover_fl = _ep_raw(cfg, T, expert_units, recompute)
    t_compute = moe_flops_per_token(cfg, T) * (b * T // tp) / (mfu * peak)
    scale = t_compute / model_fl
    nf, nb, nw, ncnt = ep_a2a_counts(recompute)
    tpc, tpx = {}, {"f": 0.0, "b": 0.0}
    if tp > 1:  # TP + SP collectives of the dense stand-in: the embedding's, a layer's (all alike), the head's
        sd = Config(cfg.name, V, C, cfg.I, 1, cfg.NH, cfg.NKV, cfg.tied, cfg.HD)
        for (label, _, _, _), calls in zip(step_items(sd, T), tp_item_calls(sd, b, T, tp, act_bytes, recompute)):
            tpc[label.replace("block 0 ", "block ")] = sum(
                t_ring(tp, S, fabric.B_intra, fabric.a_intra, allreduce=(op == "allreduce")) for op, S, _ in calls)
        if ep > 1:
            # Under EP an MoE layer's MLP collectives move slots, not tokens: each TP rank dispatches
            # its own b T / tp rows' slots, and the TP group all-gathers what its EP rank receives
            # (the experts are sliced by TP) and reduce-scatters the outputs: one collective of
            # k F (F = b T C e) with each all-to-all. The dense MLP's (2 forward, 3 backward, + 1
            # with full recompute, of F) go, unless a shared expert needs them.
            F = b * T * C * act_bytes
            tF = t_ring(tp, F, fabric.B_intra, fabric.a_intra)
            tkF = t_ring(tp, cfg.k * F, fabric.B_intra, fabric.a_intra)
            tpx = {"f": nf * tkF - (0 if cfg.IS else 2 * tF),
                   "b": (nb + nw) * tkF - (0 if cfg.IS else (4 if full else 3) * tF)}
    # An MoE layer's all-to-alls: each GPU sends the k slots of its b T / tp rows.
    t1 = ep_a2a_time(fabric, ep, tp, b * T // tp * cfg.k * C * act_bytes)
    tc = ep_counts_time(fabric, ep, tp, cfg.E)
    a2a = {"f": nf * t1 + tc, "b": (nb + nw) * t1 + (ncnt - 1) * tc, "w": nw * t1}
    items, made = [], {}  # the items of layers of one kind differ only in label, block, layer (and units)
    for label, blk, d, g, fl, rfl, wfl, rs, l, part, tkey in raw:
        moe = l is not None and cfg.is_moe_layer(l)
        if tkey not in made:
            key = label if l is None else "block " + label.split()[-1]
            it = {"g": gather(g) if g is not None else 0.0, "r": [reduce(u) for u in rs], "c": scale * (fl + rfl),
                  "tw": scale * wfl, "tp": tpc.get(key, 0.0) if part != "ex" else 0.0, "a2a": 0.0, "a2a_w": 0.0,
                  "x": 0.0}
            if ep > 1 and part in ("ex", "all") and moe:
                it["a2a"] = a2a[d]
                it["a2a_w"] = a2a["w"] if d == "b" else 0.0
                it["tp"] += tpx[d]
                it["x"] = max(0.0, a2a[d] - scale * cover_fl[d]) if a2a_overlap else a2a[d]
            made[tkey] = it
        items.append({**made[tkey], "label": label, "block": blk, "dir": d, "layer": l})
    return items


EP_SEQ = 4096  # DeepSeek-V3's pre-training sequence length (arXiv 2412.19437, section 4.2)


def ep_block_sums(cfg, items):
    """Per block (0 .. L+1) of ep_items' micro-batch: forward, backward and weight-gradient seconds
    on the critical path (compute + TP + all-to-all; the head's forward + backward split 1/3 : 2/3
    by its FLOPs, as pp_stage_times; the weight-gradient part: the GEMMs' share and the re-sent
    inputs' all-to-all), and the parts {c, tp, x, a2a} summed per block."""
    nb = cfg.L + 2
    fwd, bwd, wgt = [0.0] * nb, [0.0] * nb, [0.0] * nb
    part = {k: [0.0] * nb for k in ("c", "tp", "x", "a2a")}
    for it in items:
        k, t = it["block"], it["c"] + it["tp"] + it["x"]
        if it["dir"] == "fb":
            fwd[k] += t / 3
            bwd[k] += 2 * t / 3
        elif it["dir"] == "f":
            fwd[k] += t
        else:
            bwd[k] += t
        wgt[k] += it["tw"] + (it["x"] * it["a2a_w"] / it["a2a"] if it["a2a"] else 0.0)
        for key in part:
            part[key][k] += it[key]
    return fwd, bwd, wgt, part


def ep_point(cfg, fabric, world, ep=1, tp=1, pp=1, schedule="1f1b", v=1, micro_batch=1, global_tokens=GLOBAL_TOKENS,
             T=EP_SEQ, mfu=MFU_TARGET, prec=None, recompute="none", act_bytes=2, prefetch=1, peak=PEAK_BF16,
             expert_units=True, a2a_overlap=False, items=None, blocks=None):
    """Tokens/s per GPU of an MoE mesh point, W = pp x dp x tp, EP groups of ep ranks inside the
    dp ranks (docs/scaling.md, "Expert parallelism (issue 56)"). m = global sequences / (dp b)
    micro-batches per step. pp 1: each micro-batch gathers and reduces every unit (simulate,
    `prefetch`), step = m x micro-batch + the TP norms' all-reduce once. pp > 1: as pp_point (the
    slowest rank's m (tf + ti + tw) + bubble + the stage-boundary transfers + rank 0's per-step
    FSDP gathers and reduce-scatters + the TP norms / pp), the all-to-alls in the compute of
    their items (the re-sent inputs' in tw). items, blocks: ep_items' and ep_block_sums' (the
    search reuses them).
    Returns step, tok_s, mfu (achieved: model FLOPs / peak), m, dp, bubble_frac, a2a_busy (all the
    all-to-all time of a step, the slowest stage's under PP) and the step's parts, which add up to
    it: t_compute, t_tp, t_fsdp (exposed), t_a2a (on the critical path), t_bubble (pipeline
    bubble + stage transfers)."""
    prec = prec or Precision("bf16-noslab")
    if world % (pp * tp):
        raise ValueError("W = %d is not a multiple of pp x tp = %d" % (world, pp * tp))
    dp = world // (pp * tp)
    if dp % ep:
        raise ValueError("ep %d must divide dp %d" % (ep, dp))
    seqs = global_tokens // T
    if seqs % (dp * micro_batch):
        raise ValueError("%d sequences do not split into dp %d x micro-batch %d" % (seqs, dp, micro_batch))
    m = seqs // (dp * micro_batch)
    if items is None:
        items = ep_items(cfg, T, micro_batch, tp, ep, dp, fabric, prec, mfu, recompute, act_bytes, expert_units,
                         a2a_overlap, peak)
    t_norm = tp_norm_time(cfg.dense_standin(), Topology(fabric, world // pp, "fsdp", tp))
    tok_gpu = global_tokens / world
    busy = lambda it: it["c"] + it["tp"] + it["x"]
    if pp == 1:
        step_mb, _, _, exposed = simulate([(it["label"], it["g"], busy(it), it["r"]) for it in items], prefetch)
        parts = {"t_compute": m * sum(it["c"] for it in items), "t_tp": m * sum(it["tp"] for it in items) + t_norm,
                 "t_fsdp": m * exposed, "t_a2a": m * sum(it["x"] for it in items), "t_bubble": 0.0}
        step = m * step_mb + t_norm
        bubble_frac = 0.0
        a2a_busy = m * sum(it["a2a"] for it in items)
    else:
        if schedule == "interleaved" and m % pp:
            raise ValueError("interleaved needs m = %d a multiple of pp = %d" % (m, pp))
        vv = v if schedule == "interleaved" else 1
        fwd, bwd, wgt, part = blocks or ep_block_sums(cfg, items)
        chunks = pp_chunks(cfg, pp, vv)
        ranks = []
        for r in range(pp):
            blocks = [k for c in range(r, pp * vv, pp) for k in chunks[c]]
            tf, tw = sum(fwd[k] for k in blocks), sum(wgt[k] for k in blocks)
            ranks.append({"blocks": blocks, "tf": tf, "tw": tw, "ti": sum(bwd[k] for k in blocks) - tw})
        slow = max(ranks, key=lambda x: x["tf"] + x["ti"] + x["tw"])
        tf, ti, tw = slow["tf"], slow["ti"], slow["tw"]
        bubble = pp_bubble_time(schedule, pp, tf, ti, tw, vv)
        pipeline = m * (tf + ti + tw) + bubble
        B, a = (fabric.B_nic, fabric.a_inter) if world > fabric.g else (fabric.B_intra, fabric.a_intra)
        t_p2p = a + pp_p2p_bytes(micro_batch, T, cfg.C, tp, 1, act_bytes) / B
        p2p = 2 * (pp * vv - 1) * t_p2p
        p2p += m * vv * (max(0.0, t_p2p - tf / vv) + max(0.0, t_p2p - (ti + tw) / vv))
        b0 = set(ranks[0]["blocks"])
        fitems = [(it["label"], it["g"], busy(it) / 3 if it["dir"] == "fb" else busy(it), [])
                  for it in items if it["block"] in b0 and it["dir"] in ("f", "fb")]
        bitems = [(it["label"], 0.0, 2 * busy(it) / 3 if it["dir"] == "fb" else busy(it), it["r"])
                  for it in items if it["block"] in b0 and it["dir"] in ("b", "fb")]
        fsdp = simulate(fitems, prefetch)[3] + simulate(bitems, prefetch)[3]
        sb = slow["blocks"]
        parts = {"t_compute": m * sum(part["c"][k] for k in sb), "t_tp": m * sum(part["tp"][k] for k in sb) + t_norm / pp,
                 "t_fsdp": fsdp, "t_a2a": m * sum(part["x"][k] for k in sb), "t_bubble": bubble + p2p}
        step = pipeline + p2p + fsdp + t_norm / pp
        bubble_frac = bubble / pipeline
        a2a_busy = m * sum(part["a2a"][k] for k in sb)
    tok_s = tok_gpu / step
    r = {"step": step, "tok_s": tok_s, "mfu": tok_s * moe_flops_per_token(cfg, T) / peak, "m": m, "dp": dp,
         "bubble_frac": bubble_frac, "a2a_busy": a2a_busy}
    r.update(parts)
    return r


_EP_STAGES = {}  # ep_memory's per-rank parameter bytes by (config, W, P, tp, ep, v, expert_units)


def ep_memory(cfg, W, P, tp, ep, b, T, schedule, v, m, recompute, expert_units=True, rows="balanced"):
    """Coarse bytes per GPU of the most loaded pipeline rank (MoE stages differ: the largest of the
    P ranks' sums; pp_memory takes rank 0), as pp_memory with the MoE parts:
      state    16 B x the shard of each of the rank's units (fp32 parameter, gradient, AdamW m
               and v): dense units over dp, expert units (E / ep experts) over dp / ep, so the
               experts cost 16 B x E experts / (dp tp) per GPU with or without expert units;
      FSDP     P = 1: 2 x (2 + 4) B x the largest unit (bf16 gather, fp32 gradient; prefetch);
               P > 1: (2 + 4) B x all the rank's units (--pp-reshard per-step keeps a stage's
               units gathered and their gradients unsharded through the step, as --mode plan
               counts them, src/parallel/layout_memory.cpp; pp_memory counts the largest only);
      kept     per layer and micro-batch: recompute none: a dense layer 34 b T C / tp (Korthikanti
               et al. 2022, section 4: their selective figure); an MoE layer the attention and
               norms' share of it, (11 + 4) b T C / tp, the router's fp32 probabilities and weights
               4 b T (E + k), the experts' rows as shardtrain keeps them (src/model/llama_buffers.cpp:
               g, u, h [rows, IE / tp] and the outputs [slots, C], bf16) and the shared expert as a
               dense SwiGLU (g, u, h: 3 b T IS / tp, bf16); full: 2 b T C / tp (the layer input).
               Held: P = 1 one micro-batch of every layer; gpipe m; 1f1b min(P - r, m) micro-batches
               of rank r's layers; interleaved min(m v, 2 (P - r - 1) + (v - 1) P + 1) chunks of
               1/v of them (Megatron-LM's warm-up count);
      scratch  once, on a rank with an MoE layer: the experts' gradient buffers 3 rows IE / tp, the
               gathered inputs and their gradient 2 slots C, under EP the exchange's 3 rows C (bf16);
               full recompute: one MoE layer's kept buffers more (the rerun block).
    slots = b T k (the TP group's tokens: every TP rank routes them all); rows = the rows an EP
    rank's experts get: balanced = slots; worst = ep x slots (dropless: every slot of the group may
    choose this rank's experts; what shardtrain allocates under --ep, LlamaDims::er). Returns the
    most loaded rank's {total, state, fsdp, act, scratch, rank}."""
    if rows not in ("balanced", "worst"):
        raise ValueError("rows must be balanced or worst, got %r" % rows)
    dp = W // (P * tp)
    us = moe_units(cfg, tp, ep, expert_units)
    n_of = {"dense": dp, "expert": dp // ep}
    chunks = pp_chunks(cfg, P, v)
    BT, C = b * T, cfg.C
    slots = BT * cfg.k
    er = slots * (ep if rows == "worst" else 1)

    def kept(l, rc):
        if rc == "full":
            return 2.0 * BT * C / tp
        if not cfg.is_moe_layer(l):
            return 34.0 * BT * C / tp
        return (15.0 * BT * C / tp + 4.0 * BT * (cfg.E + cfg.k) + 2.0 * (3 * er * cfg.IE / tp + slots * C) +
                2.0 * 3 * BT * cfg.IS / tp)

    skey = (cfg.key(), W, P, tp, ep, v, expert_units)
    if skey not in _EP_STAGES:  # per rank: state, FSDP buffers, its dense and MoE layers (not on b, m, recompute)
        st = []
        for r in range(P):
            blocks = [k for c in range(r, P * v, P) for k in chunks[c]]
            layers = [k - 1 for k in blocks if 1 <= k <= cfg.L]
            u_r = list(blocks) + [expert_unit_index(cfg, l) for l in layers if expert_units and cfg.is_moe_layer(l)]
            state = 16 * sum(shard_size(us[u][1], n_of[us[u][2]]) for u in u_r)
            fsdp = 2 * 6 * max(us[u][1] for u in u_r) if P == 1 else 6 * sum(us[u][1] for u in u_r)
            n_moe = sum(1 for l in layers if cfg.is_moe_layer(l))
            st.append((state, fsdp, len(layers) - n_moe, n_moe))
        _EP_STAGES[skey] = st
    worst = None
    for r, (state, fsdp, n_dense, n_moe) in enumerate(_EP_STAGES[skey]):
        if P == 1:
            held = 1.0
        elif schedule == "gpipe":
            held = float(m)
        elif schedule == "interleaved":
            held = min(m * v, (P - r - 1) * 2 + (v - 1) * P + 1) / v
        else:
            held = float(min(P - r, m))
        act = held * (n_dense * (kept(0, recompute) if n_dense else 0.0) +
                      n_moe * (kept(cfg.dense_layers, recompute) if n_moe else 0.0))
        scratch = 0.0
        if n_moe:
            scratch = 2.0 * (3 * er * cfg.IE / tp + 2 * slots * C + (3 * er * C if ep > 1 else 0))
            if recompute == "full":
                scratch += kept(cfg.dense_layers, "none")
        d = {"total": state + fsdp + act + scratch, "state": state, "fsdp": fsdp, "act": act, "scratch": scratch,
             "rank": r}
        if worst is None or d["total"] > worst["total"]:
            worst = d
    return worst


EP_MODELS = ("mixtral-8x7b", "deepseek-v3-mha")
EP_WORLDS = PP_WORLDS
EP_TP = (1, 2, 4, 8)
EP_PP = (2, 4, 8, 16)
EP_MICRO = (1, 2, 4, 8)
EP_MAX = 64
# (key, label, EP, expert units, all-to-alls overlapped, rows the fit assumes, TP and PP searched)
EP_VARIANTS = (
    ("fsdp", "FSDP, no EP (runs today)", False, False, False, "worst", False),
    ("ep-built", "FSDP + EP as built", True, False, False, "worst", False),
    ("best", "best without EP", False, False, False, "worst", True),
    ("ep-units", "best with EP: expert units", True, True, False, "balanced", True),
    ("ep-overlap", "best with EP: expert units, all-to-all overlapped", True, True, True, "balanced", True),
)


def ep_candidates(cfg, W, with_ep, tp_pp, T=EP_SEQ, global_tokens=GLOBAL_TOKENS):
    """Mesh points (pp, tp, ep, schedule, v, b, m): tp 1, 2, 4, 8 (dividing the heads, I, IE) and
    pp 1, 2, 4, 8, 16 when tp_pp, else 1 and 1; ep 1 without EP, else the divisors 2..64 of E that
    divide dp; b 1, 2, 4, 8 sequences with m whole; pp > 1: 1f1b and interleaved v 2 (m a
    multiple of pp)."""
    seqs = global_tokens // T
    for tp in (EP_TP if tp_pp else (1,)):
        try:
            check_moe(cfg, tp)
        except ValueError:
            continue
        for pp in ((1,) + EP_PP if tp_pp else (1,)):
            if W % (pp * tp):
                continue
            dp = W // (pp * tp)
            eps = [n for n in range(2, min(EP_MAX, cfg.E) + 1) if cfg.E % n == 0 and dp % n == 0] if with_ep else [1]
            for b in EP_MICRO:
                if seqs % (dp * b):
                    continue
                m = seqs // (dp * b)
                for s, v in ((("1f1b", 1), ("interleaved", 2)) if pp > 1 else (("1f1b", 1),)):
                    if pp * v > cfg.L + 2 or (s == "interleaved" and m % pp):
                        continue
                    for ep in eps:
                        yield pp, tp, ep, s, v, b, m


def ep_best(cfg, fabric, W, variant, mfus=(MFU_TARGET,), hbm=HBM_BYTES, T=EP_SEQ, global_tokens=GLOBAL_TOKENS):
    """Per MFU, the point of ep_candidates with the most tokens/s per GPU among those whose
    ep_memory (rows as the variant says) fits hbm - HBM_RESERVE, recompute none if it fits, else
    full: {mfu: (point, None)}, or {mfu: (None, the candidate needing the least memory)} when
    none fits. A point carries mem (the fit's ep_memory) and mem_other (the other row sizing)."""
    _, _, with_ep, units, overlap, rows, tp_pp = variant
    prec = Precision("bf16-noslab")
    best, least, cache = dict.fromkeys(mfus), None, {}
    for pp, tp, ep, s, v, b, m in ep_candidates(cfg, W, with_ep, tp_pp, T, global_tokens):
        rc = None
        for r in ("none", "full"):
            mem = ep_memory(cfg, W, pp, tp, ep, b, T, s, v, m, r, units, rows)
            if mem["total"] <= hbm - HBM_RESERVE:
                rc = r
                break
        if rc is None:
            if least is None or mem["total"] < least["mem"]["total"]:
                least = {"pp": pp, "tp": tp, "ep": ep, "schedule": s, "v": v, "b": b, "m": m, "dp": W // (pp * tp),
                         "recompute": "full", "mem": mem}
            continue
        dp = W // (pp * tp)
        for mfu in mfus:
            key = (tp, ep, b, rc, dp, mfu)
            if key not in cache:
                cache[key] = [ep_items(cfg, T, b, tp, ep, dp, fabric, prec, mfu, rc, 2, units, overlap), None]
            if pp > 1 and cache[key][1] is None:
                cache[key][1] = ep_block_sums(cfg, cache[key][0])
            r = ep_point(cfg, fabric, W, ep, tp, pp, s, v, b, global_tokens, T, mfu, prec, rc, expert_units=units,
                         a2a_overlap=overlap, items=cache[key][0], blocks=cache[key][1])
            if best[mfu] is None or r["tok_s"] > best[mfu]["tok_s"]:
                r.update(pp=pp, tp=tp, ep=ep, schedule=s, v=v, b=b, recompute=rc, mem=mem)
                best[mfu] = r
    other = "balanced" if rows == "worst" else "worst"
    for r in best.values():
        if r is not None:
            r["mem_other"] = ep_memory(cfg, W, r["pp"], r["tp"], r["ep"], r["b"], T, r["schedule"], r["v"], r["m"],
                                       r["recompute"], units, other)
    return {mfu: (best[mfu], None if best[mfu] else least) for mfu in mfus}


def _ep_mesh(r):
    s = "tp %d" % r["tp"] + (" × pp %d" % r["pp"] if r["pp"] > 1 else "") + " × dp %d" % r["dp"]
    if r["ep"] > 1:
        s += " (ep %d)" % r["ep"]
    if r["pp"] > 1:
        s += ", %s%s" % (r["schedule"], " v %d" % r["v"] if r["schedule"] == "interleaved" else "")
    return s + ", b %d, m %d, %s" % (r["b"], r["m"], r["recompute"])


def ep_tables(out=sys.stdout, mfus=(MFU_TARGET, MFU_MEASURED), worlds=EP_WORLDS, models=EP_MODELS):
    """docs/scaling.md, "Expert parallelism (issue 56)": the best mesh with and without EP."""
    p = lambda s="": print(s, file=out)
    fab = FABRICS["nvlink+ndr"]
    for mname in models:
        cfg = load_moe_config(mname)
        fpt = moe_flops_per_token(cfg, EP_SEQ)
        line = ("**%s**: %s parameters, %s active (6 N_active + 12 L Q T = %.4g FLOP per token at T = %d); "
                "E %d, top %d, experts %d wide" % (mname, format(cfg.num_params(), ","), format(cfg.num_active_params(), ","),
                                                   fpt, EP_SEQ, cfg.E, cfg.k, cfg.IE))
        if cfg.IS:
            line += ", a shared expert %d wide" % cfg.IS
        if cfg.dense_layers:
            line += ", the first %d layers dense (MLP %d wide)" % (cfg.dense_layers, cfg.I)
        p(line + ".")
        if mname == "deepseek-v3-mha":
            tot, act = dsv3_mla_counts(cfg)
            mla = dsv3_mla_attn_flops(cfg, EP_SEQ)
            p("Attention as multi-head attention of head_dim %d: %s parameters a layer, against MLA's %s "
              "(with MLA and the gate's bias: %s total, %s active; DeepSeek states 671B and 37B). MLA's attention "
              "FLOPs, %.4g per token at T = %d, are %.2f times this model's %.4g: its compute per token is %.1f%% "
              "below DeepSeek-V3's." % (
                  cfg.HD, format(cfg.attn_numel(), ","), format(mla_attn_numel(cfg.C, cfg.NH, *DSV3_MLA), ","),
                  format(tot, ","), format(act, ","), mla, EP_SEQ, mla / (12.0 * cfg.L * cfg.Q * EP_SEQ),
                  12.0 * cfg.L * cfg.Q * EP_SEQ, 100 * (1 - fpt / (6.0 * act + mla))))
        p()
        p("HSDP (units sharded over one node's %d GPUs): %.0f GB of parameters and AdamW state per GPU > %.0f GB, "
          "not searched." % (fab.g, 16.0 * cfg.num_params() / fab.g / 1e9, HBM_BYTES / 1e9))
        p()
        res = {(W, var[0]): ep_best(cfg, fab, W, var, mfus) for W in worlds for var in EP_VARIANTS}
        for mfu in mfus:
            p("**%s, MFU %.1f%%**, seq %d, global batch %s tokens (%d sequences), %s, bf16 gather, fp32 reduce in one "
              "call per unit, prefetch 1, %d GB per GPU. Mesh: tp × pp × dp (ep: the EP group's size, inside dp), "
              "micro-batch b sequences, m micro-batches per step, recompute. Step parts: compute / TP / FSDP exposed / "
              "all-to-all on the critical path / bubble + stage transfers, s. GB per GPU: expert buffers sized for "
              "the worst case / for balanced routing; the fit is judged on the first in the first three rows of a W, "
              "on the second in the last two." % (mname, 100 * mfu, EP_SEQ, format(GLOBAL_TOKENS, ","),
                                                 GLOBAL_TOKENS // EP_SEQ, fab.name, HBM_BYTES / 1e9))
            p()
            p("| W | variant | mesh | tokens/s per GPU | MFU | step s: compute / TP / FSDP / all-to-all / bubble | GB per GPU | vs no EP |")
            p("|---|---|---|---|---|---|---|---|")
            for W in worlds:
                for var in EP_VARIANTS:
                    r, least = res[(W, var[0])][mfu]
                    if r is None:
                        p("| %d | %s | does not fit (least: %s, %.0f GB) | - | - | - | - | - |" % (
                            W, var[1], _ep_mesh(least), least["mem"]["total"] / 1e9))
                        continue
                    worst, bal = (r["mem"], r["mem_other"]) if var[5] == "worst" else (r["mem_other"], r["mem"])
                    base = None
                    if var[2]:
                        base = res[(W, "fsdp" if var[0] == "ep-built" else "best")][mfu][0]
                    ratio = "%+.0f%%" % (100 * (r["tok_s"] / base["tok_s"] - 1)) if base else "-"
                    p("| %d | %s | %s | %s | %.1f%% | %.1f / %.1f / %.1f / %.1f / %.1f | %.0f / %.0f | %s |" % (
                        W, var[1], _ep_mesh(r), format(round(r["tok_s"]), ","), 100 * r["mfu"], r["t_compute"],
                        r["t_tp"], r["t_fsdp"], r["t_a2a"], r["t_bubble"], worst["total"] / 1e9, bal["total"] / 1e9,
                        ratio))
            p()


EP_LAYER_POINTS = (("mixtral-8x7b", (2, 4, 8)), ("deepseek-v3-mha", (8, 16, 32, 64)))


def ep_layer_table(out=sys.stdout, W=256, T=EP_SEQ, mfu=MFU_TARGET):
    """One MoE layer of one micro-batch of one sequence per GPU, tp 1, pp 1, dp = W: what EP moves
    and what it saves, beside the layer's compute (docs/scaling.md)."""
    p = lambda s="": print(s, file=out)
    fab = FABRICS["nvlink+ndr"]
    prec = Precision("bf16-noslab")
    p("**One MoE layer, one sequence of %d tokens per GPU, tp 1, dp %d, bf16, %s.** All-to-all: bytes one GPU "
      "sends (ep_a2a_bytes), one all-to-all's time (ep_a2a_time), the layer's 5 and the counts' all-gather. "
      "Compute: the layer's forward + backward at MFU %.0f%%. Experts' FSDP gather per GPU: all E experts over "
      "dp (as built) against the E / ep of an expert unit over dp / ep (next step), bytes and ring time." % (
          T, W, fab.name, 100 * mfu))
    p()
    p("| model | ep | MB per all-to-all | one all-to-all, ms | 5 + counts, ms | compute, ms | all-to-all / compute | "
      "experts' gather as built, GB / ms | expert unit's gather, GB / ms |")
    p("|---|---|---|---|---|---|---|---|---|")
    for mname, eps in EP_LAYER_POINTS:
        cfg = load_moe_config(mname)
        l = cfg.dense_layers
        ne, ex = cfg.nonexpert_numel(l), cfg.layer_numel(l, 1, cfg.k) - cfg.nonexpert_numel(l)
        compute = 3 * (2.0 * (ne + ex) + 4.0 * cfg.Q * T) * T / (mfu * PEAK_BF16)
        e_all = cfg.E * cfg.expert_numel()
        for ep in eps:
            send = T * cfg.k * cfg.C * 2
            t1 = ep_a2a_time(fab, ep, 1, send)
            tl = 5 * t1 + ep_counts_time(fab, ep, 1, cfg.E)
            g_all = (W - 1) / W * shard_size(e_all, W) * W * prec.ag
            B, a = ep_link(fab, W, 1)
            t_all = t_ring(W, shard_size(e_all, W) * W * prec.ag, B, a)
            n = W // ep
            e_u = e_all // ep
            g_u = (n - 1) / n * shard_size(e_u, n) * n * prec.ag
            B, a = ep_link(fab, n, ep)
            t_u = t_ring(n, shard_size(e_u, n) * n * prec.ag, B, a)
            p("| %s | %d | %.1f | %.2f | %.1f | %.1f | %.2f | %.2f / %.1f | %.2f / %.1f |" % (
                mname, ep, ep_a2a_bytes(cfg, T, ep) / 1e6, 1e3 * t1, 1e3 * tl, 1e3 * compute, tl / compute,
                g_all / 1e9, 1e3 * t_all, g_u / 1e9, 1e3 * t_u))
    p()


def cmd_ep_tables(a):
    ep_layer_table()
    ep_tables()


# ---- check --------------------------------------------------------------------------------

def load_bench(path, stat="median"):
    """comm_bandwidth's JSON lines -> {world: {(op, dtype): [(bytes, seconds), ...] sorted}},
    seconds = the median (default) or the minimum over the repetitions."""
    runs = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            j = json.loads(line)
            d = runs.setdefault(int(j["world"]), {})
            for r in j["results"]:
                d.setdefault((r["op"], r["dtype"]), []).append((int(r["bytes"]), float(r[stat + "_s"])))
    for d in runs.values():
        for k in d:
            d[k].sort()
    return runs


def interp_time(points, nbytes):
    """Measured time of a collective of nbytes total: linear interpolation between the measured
    sizes; beyond them, the nearest two points' line (t = a + S / algbw); never below 0."""
    xs = [x for x, _ in points]
    if len(points) == 1:
        return points[0][1] * nbytes / points[0][0]
    i = bisect.bisect_left(xs, nbytes)
    i = min(max(i, 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0))


def fit_line(points):
    """Least squares t = alpha + S / B over the measured sizes: (alpha seconds, B bytes/s of S)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, 1.0 / b


def cpu_step_calls(cfg, world, prec, micro_batches=1):
    """Every collective call of one optimizer step of a CPU run, as (op, dtype, total bytes S),
    following Fsdp's slabs and then MpiComm's (kCollectiveSlab)."""
    us = units(cfg)
    max_S = max(shard_size(n, world) for _, n in us)
    calls = []
    dt = {4: "float32", 2: "bf16"}
    for _, g, _, rs in step_items(cfg, 1):
        if g is not None:
            S = shard_size(us[g][1], world)
            for c in mpi_split(S, world, prec.ag):
                calls.append(("allgather", dt[prec.ag], c * world * prec.ag))
        for u in rs:
            S = shard_size(us[u][1], world)
            for c0 in rs_calls(S, max_S, world, prec):
                for c in mpi_split(c0, world, prec.rs):
                    calls.append(("reduce_scatter", dt[prec.rs], c * world * prec.rs))
    return calls * micro_batches


def predict_comm(cfg, world, prec, bench, micro_batches=1):
    pts = bench[world]
    total = 0.0
    for op, dtype, nbytes in cpu_step_calls(cfg, world, prec, micro_batches):
        key = (op, dtype)
        if key not in pts:
            raise KeyError("no measured %s %s at W = %d in the bandwidth file" % (op, dtype, world))
        total += interp_time(pts[key], nbytes)
    return total


def predict_exposed(cfg, world, prec, bench, compute_s, T, prefetch, micro_batches=1):
    """Exposed communication of the overlap schedule (simulate) with the measured per-call times
    and a measured compute time per step spread over the items by their FLOPs."""
    pts = bench[world]
    us = units(cfg)
    max_S = max(shard_size(n, world) for _, n in us)
    dt = {4: "float32", 2: "bf16"}

    def t_of(op, e, count):
        return sum(interp_time(pts[(op, dt[e])], c * world * e) for c in mpi_split(count, world, e))

    raw = step_items(cfg, T)
    real = sum(fl for _, _, fl, _ in raw)
    items = []
    for label, g, fl, rs in raw:
        tg = t_of("allgather", prec.ag, shard_size(us[g][1], world)) if g is not None else 0.0
        tr = [sum(t_of("reduce_scatter", prec.rs, c) for c in rs_calls(shard_size(us[u][1], world), max_S, world, prec))
              for u in rs]
        items.append((label, tg, compute_s / micro_batches * fl / real, tr))
    exposed = simulate(items, prefetch)[3]
    return exposed * micro_batches


def tp_cpu_calls(cfg, B, T, tp, elem_bytes, micro_batches=1, recompute="none", loss_chunk=None):
    """Every TP collective call of one optimizer step of a CPU run, as (op, dtype, total bytes S),
    after MpiComm's slabs (kCollectiveSlab, as for Fsdp's calls; assumed to apply to the TP
    group's calls too): micro_batches x the micro-batch's calls, then, once per step, the
    replicated norms' fp32 all-reduces (tp_norm_allreduce, dp_shard = 1: 2L + 1 of C floats). The
    all-reduces are kept whole (at most 2 x chunk floats, or C)."""
    dt = {4: "float32", 2: "bf16"}
    calls = []
    for c in tp_item_calls(cfg, B, T, tp, elem_bytes, recompute, loss_chunk):
        for op, S, e in c:
            if op == "allreduce":
                calls.append((op, dt[e], S))
                continue
            for k in mpi_split(S // (tp * e), tp, e):
                calls.append((op, dt[e], k * tp * e))
    norms = [("allreduce", "float32", cfg.C * 4)] * tp_norm_allreduce(cfg, tp)[0]
    return calls * micro_batches + norms


def predict_tp_comm(cfg, B, T, tp, elem_bytes, bench, micro_batches=1, recompute="none", loss_chunk=None):
    """Seconds per optimizer step of the TP collectives of a CPU run (--tp tp, micro-batch B x T per
    TP group, micro_batches per step), from comm_bandwidth's measured times at world = tp (the TP
    group; at W = 2, TP 2 it is the whole world): the sum over tp_cpu_calls of the interpolated
    time of a call of that size (the replicated norms' all-reduce once per step, dp_shard = 1).
    They block, so all of it is exposed. An all-reduce the bandwidth
    file does not hold (comm_bandwidth measures none today) is timed as a reduce-scatter plus an
    all-gather of the same bytes (the ring all-reduce)."""
    pts = bench[tp]
    total = 0.0
    for op, dtype, nbytes in tp_cpu_calls(cfg, B, T, tp, elem_bytes, micro_batches, recompute, loss_chunk):
        if (op, dtype) in pts:
            total += interp_time(pts[(op, dtype)], nbytes)
        elif op == "allreduce" and ("reduce_scatter", dtype) in pts and ("allgather", dtype) in pts:
            total += interp_time(pts[("reduce_scatter", dtype)], nbytes) + interp_time(pts[("allgather", dtype)], nbytes)
        else:
            raise KeyError("no measured %s %s at W = %d in the bandwidth file" % (op, dtype, tp))
    return total


def cmd_predict_tp_cpu(a, out=sys.stdout):
    cfg = load_config(a.model)
    e = {"fp32": 4, "bf16": 2}[a.act_dtype]
    bench = load_bench(a.bandwidth_json, a.bench_stat)
    if a.tp not in bench:
        raise SystemExit("predict-tp-cpu: no bandwidth run at W = %d (the TP group) in %s" % (a.tp, a.bandwidth_json))
    b = tp_bytes_per_microbatch(cfg, a.micro_batch, a.seq_len, a.tp, e, a.recompute, a.loss_chunk)
    calls = tp_cpu_calls(cfg, a.micro_batch, a.seq_len, a.tp, e, a.accum, a.recompute, a.loss_chunk)
    p = lambda s="": print(s, file=out)
    p("model %s, tp %d, micro-batch %d x %d, %d micro-batch(es) per step, %s activations, recompute %s" %
      (cfg.name, a.tp, a.micro_batch, a.seq_len, a.accum, a.act_dtype, a.recompute))
    p("per micro-batch per rank: F = %d bytes; calls all-gather %d, reduce-scatter %d, all-reduce %d; "
      "bytes sent all-gather %.0f, reduce-scatter %.0f, all-reduce %.0f (per layer %.0f)" %
      (b["F"], b["calls"]["all_gather"], b["calls"]["reduce_scatter"], b["calls"]["all_reduce"],
       b["all_gather"], b["reduce_scatter"], b["all_reduce"], b["per_layer"]))
    nc, nb = tp_norm_allreduce(cfg, a.tp)
    st = tp_bytes_per_step(cfg, a.micro_batch, a.seq_len, a.tp, e, a.accum, a.recompute, a.loss_chunk)
    p("per step, once: the replicated norms' all-reduce, %d calls of %d fp32, %.0f bytes sent (dp_shard = 1)" %
      (nc, cfg.C, nb))
    p("per step per rank (as the metrics' tp_bytes, tp_collectives): %.0f bytes in %d collectives" %
      (st["bytes"], st["calls"]))
    t = predict_tp_comm(cfg, a.micro_batch, a.seq_len, a.tp, e, bench, a.accum, a.recompute, a.loss_chunk)
    p("per step: %d calls after MpiComm's slabs; predicted TP communication %.2f ms" % (len(calls), t * 1e3))
    return t


def read_metrics(path, skip):
    """Step rows of a --metrics JSONL file (rows with 'step' and 'loss'), the first `skip` dropped."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                j = json.loads(line)
                if "step" in j and "loss" in j:
                    rows.append(j)
    rows.sort(key=lambda r: r["step"])
    return rows[skip:]


def mean_field(rows, key):
    vals = [float(r[key]) for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None


def check(a, out=sys.stdout):
    if len(a.metrics) != len(a.world):
        raise SystemExit("check: give --metrics and --world in pairs")
    cfg = load_config(a.model)
    prec = Precision(a.precision)
    bench = load_bench(a.bandwidth_json, getattr(a, "bench_stat", "median"))
    p = lambda s="": print(s, file=out)
    p("model %s (%d parameters), precision %s, seq %d, micro-batch %d, %d micro-batch(es) per step, "
      "prefetch %d for the exposed prediction" %
      (cfg.name, cfg.num_params(), prec.name, a.seq_len, a.micro_batch, a.accum, a.prefetch))
    for W in sorted(bench):
        for key, pts in sorted(bench[W].items()):
            bw = lambda S: S / interp_time(pts, S) / 1e9 * (W - 1) / W
            p("measured W=%d %-14s %-7s busbw GB/s at 64 KiB / 1 MiB / 16 MiB / 64 MiB: %s" %
              (W, key[0], key[1], " / ".join("%.2f" % bw(S) for S in (1 << 16, 1 << 20, 1 << 24, 1 << 26))))
    p()
    if not a.metrics:  # predictions only
        p("| W | collective calls per step | all-gather MB | reduce-scatter MB | predicted comm ms |")
        p("|---|---|---|---|---|")
        for W in sorted(bench):
            calls = cpu_step_calls(cfg, W, prec, a.accum)
            agb = sum(b for op, _, b in calls if op == "allgather") * (W - 1) / W
            rsb = sum(b for op, _, b in calls if op == "reduce_scatter") * (W - 1) / W
            p("| %d | %d | %.1f | %.1f | %.1f |" % (W, len(calls), agb / 1e6, rsb / 1e6,
                                                  predict_comm(cfg, W, prec, bench, a.accum) * 1e3))
        p()
        p("(MB: bytes each rank sends, ring (W-1)/W.)")
        return []
    p("| W | metrics | steps | predicted comm ms | measured comm_ms | error | predicted exposed ms | measured exposed_comm_ms | error | compute_ms |")
    p("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for path, W in zip(a.metrics, a.world):
        if W not in bench:
            raise SystemExit("check: no bandwidth run at W = %d in %s" % (W, a.bandwidth_json))
        rows = read_metrics(path, a.skip)
        if not rows:
            raise SystemExit("check: %s has no step rows after the first %d" % (path, a.skip))
        pred = predict_comm(cfg, W, prec, bench, a.accum)
        meas = mean_field(rows, "comm_ms")
        exp_meas = mean_field(rows, "exposed_comm_ms")
        comp = mean_field(rows, "compute_ms")
        pred_exp = None
        if comp is not None:
            pred_exp = predict_exposed(cfg, W, prec, bench, comp / 1e3, a.seq_len, a.prefetch, a.accum)
        err = lambda pr, me: "%+.1f%%" % (100 * (pr - me) / me) if (pr is not None and me) else "-"
        f = lambda x: "%.2f" % x if x is not None else "-"
        p("| %d | %s | %d | %.2f | %s | %s | %s | %s | %s | %s |" %
          (W, os.path.basename(path), len(rows), pred * 1e3, f(meas), err(pred * 1e3, meas),
           f(pred_exp * 1e3 if pred_exp is not None else None), f(exp_meas),
           err(pred_exp * 1e3 if pred_exp is not None else None, exp_meas), f(comp)))
        results.append({"world": W, "predicted_comm_ms": pred * 1e3, "measured_comm_ms": meas,
                        "predicted_exposed_ms": None if pred_exp is None else pred_exp * 1e3,
                        "measured_exposed_ms": exp_meas, "compute_ms": comp})
    p()
    p("error = (predicted - measured) / measured; measured = mean over the step rows after the first %d." % a.skip)
    return results


# ---- selftest -----------------------------------------------------------------------------

def selftest():
    # Parameter counts of the published models (src/model/config.cpp comments).
    assert load_config("llama-1b").num_params() == 1235814400
    assert load_config("llama-8b").num_params() == 8030261248
    assert load_config("llama-405b").num_params() == 405853388800  # meta-llama/Llama-3.1-405B
    c = load_config("llama-1b")
    assert sum(n for _, n in units(c)) == c.num_params()
    assert shard_size(2, 4) == 1 and shard_size(0, 4) == 1 and shard_size(9, 4) == 3
    # Collective counts: tied: embedding gathered and reduced twice, final norm gathered twice.
    ag, rs = collective_counts(c)
    assert ag[0] == 2 and rs[0] == 2 and ag[1] == 2 and rs[1] == 1 and ag[-1] == 2 and rs[-1] == 1
    ag, rs = collective_counts(load_config("llama-8b"))
    assert ag[0] == 1 and rs[0] == 1 and ag[-1] == 1 and rs[-1] == 1
    # Ring cost: 8 ranks, 8 GB over 1 GB/s bus: 7/8 x 8 = 7 s + 7 alpha.
    assert abs(t_ring(8, 8e9, 1e9, 0.5) - (7 + 3.5)) < 1e-9
    assert abs(t_ring(4, 4e9, 1e9, 0.0, allreduce=True) - 6.0) < 1e-9
    # Schedule: two items, gather 1 s each, compute 2 s each, one reduce of 1 s after the last.
    items = [("a", 1.0, 2.0, []), ("b", 1.0, 2.0, [1.0])]
    assert simulate(items, 0) == (7.0, 4.0, 3.0, 3.0)
    # prefetch 1: g0 0-1, c0 1-3 (g1 1-2 hidden), c1 3-5, r1 5-6: step 6, exposed 2.
    assert simulate(items, 1) == (6.0, 4.0, 3.0, 2.0)
    # A gather longer than the compute before it is exposed by the difference.
    items = [("a", 1.0, 1.0, []), ("b", 3.0, 1.0, [])]
    # g0 0-1, c0 1-2, g1 1-4 (issued at 1), c1 4-5: exposed = 5 - 2 = 3.
    assert simulate(items, 1)[3] == 3.0
    # prefetch 2 issues g1 at 0 too: g0 0-1, g1 1-4, c0 1-2, c1 4-5: the same here.
    assert simulate(items, 2)[3] == 3.0
    # Reduce-scatter slabs: fp32 at W = 2: 2^21 elements per call.
    pr = Precision("fp32")
    assert rs_calls(5 * 2 ** 20, 10 ** 9, 2, pr) == [2 ** 21, 2 ** 21, 2 ** 20]
    assert rs_calls(5 * 2 ** 20, 10 ** 9, 2, Precision("bf16-rbf16")) == [5 * 2 ** 20]
    assert mpi_split(10, 2, 4) == [10] and mpi_split(2 ** 21 + 1, 2, 4) == [2 ** 21, 1]
    # Bytes: fp32, W = 2, tiny (tied): (W-1)/W x padded x 4 per collective.
    t = load_config("tiny")
    agb, rsb = bytes_per_step(t, 2, pr)
    u = units(t)
    exp_ag = sum(k * 0.5 * shard_size(n, 2) * 2 * 4 for k, (_, n) in zip(collective_counts(t)[0], u))
    assert abs(agb - exp_ag) < 1e-6
    # Interpolation and the line fit.
    pts = [(100, 1.0), (200, 2.0), (400, 3.0)]
    assert interp_time(pts, 150) == 1.5 and interp_time(pts, 800) == 5.0 and interp_time(pts, 50) == 0.5
    al, B = fit_line([(1e6, 1e-3 + 1e-3), (2e6, 1e-3 + 2e-3)])
    assert abs(al - 1e-3) < 1e-12 and abs(B - 1e9) < 1e-3
    # Tensor parallelism. llama-70b's published count; tp = 1 leaves the units as they were.
    c70 = load_config("llama-70b")
    assert c70.num_params() == 70553706496
    assert units(c70, 1) == units(c70) and units(c, 1) == units(c)
    # TP slices: tp x a slice = the whole, but for the replicated norms (2C per layer, C final).
    for cf in (c70, load_config("llama-8b"), c):
        for tp in (2, 4, 8):
            whole = tp * sum(n for _, n in units(cf, tp))
            assert whole == cf.num_params() + (tp - 1) * (2 * cf.C * cf.L + cf.C), (cf.name, tp)
    assert bytes_per_step(c70, 64, Precision("bf16"), tp=1) == bytes_per_step(c70, 64, Precision("bf16"))
    # A llama-70b layer's slice at tp 8: 2C + C Q/8 + 2 C KV/8 + Q/8 C + 3 C I/8.
    assert c70.block_numel(8) == 2 * 8192 + 8192 * 1024 + 2 * 8192 * 128 + 1024 * 8192 + 3 * 8192 * 3584
    # Vocabulary padding: V = 258 at tp 4 (not a divisor of tiny's heads; vocab_rows alone) -> 65 rows.
    assert t.vocab_rows(4) == 65 and t.vocab_rows(2) == 129
    # tiny (L 2, C 32), B 1, T 4, tp 2, fp32: F = 512 bytes; per layer 10 x 1/2 x 512 = 2560.
    b = tp_bytes_per_microbatch(t, 1, 4, 2, 4)
    assert b["F"] == 512 and b["per_layer"] == 2560.0
    # One loss chunk (4 tokens): one all-gather of 4 fp32 maxima per rank ((tp-1) x 4 x 4 = 16 bytes
    # sent), one all-reduce of 2 x 4 fp32 (2 (tp-1)/tp x 32 = 32 bytes).
    assert b["calls"] == {"all_gather": 2 * 6 + 2 + 1, "reduce_scatter": 2 * 4 + 2, "all_reduce": 1}
    assert b["all_gather"] == 14 * 256.0 + 16 and b["reduce_scatter"] == 10 * 256.0
    assert b["all_reduce"] == 2 * 4 * 4 * 2 * 0.5  # 2 B T floats, ring all-reduce 2 (tp-1)/tp
    assert b["all_gather"] - 16 + b["reduce_scatter"] - 2 * 2 * 256 == 2 * b["per_layer"]  # L layers + embed + head
    bf = tp_bytes_per_microbatch(t, 1, 4, 2, 4, "full")
    assert bf["per_layer"] == 13 * 256.0 and bf["calls"]["all_gather"] == 2 * 8 + 2 + 1 and bf["calls"]["reduce_scatter"] == 2 * 5 + 2
    assert tp_bytes_per_microbatch(t, 1, 4, 2, 4, "selective") == b
    b1 = tp_bytes_per_microbatch(t, 1, 4, 1, 4, "full")
    assert b1["all_gather"] == b1["reduce_scatter"] == b1["all_reduce"] == b1["per_layer"] == 0
    # Loss chunks: 1,000 tokens in chunks of 256: 4 chunks, 4 all-gathers of the maxima (1,000 fp32
    # sent per rank at tp 2) and 4 all-reduces of 2 x 1000 floats in all.
    bc = tp_bytes_per_microbatch(t, 1, 1000, 2, 2, loss_chunk=256)
    assert bc["calls"]["all_reduce"] == 4 and bc["calls"]["all_gather"] == 14 + 4 and bc["all_reduce"] == 2 * 1000 * 4
    assert bc["all_gather"] == 14 * 1000 * 32 * 2 / 2 + 1000 * 4
    # The default chunk is default_loss_chunk(Vl), Vl = ceil(V / tp): llama-8b at tp 4, 2^24 // 32064 = 523.
    c8 = load_config("llama-8b")
    assert default_loss_chunk(c8.vocab_rows(4)) == 523 and default_loss_chunk(c8.V) == 256
    assert tp_bytes_per_microbatch(c8, 1, 2048, 4, 2)["calls"]["all_reduce"] == 4  # ceil(2048 / 523)
    # The replicated norms, once per step: 2L + 1 all-reduces of C fp32 (tiny at tp 2: 5 of 32).
    assert tp_norm_allreduce(t, 2) == (5, 5 * 2 * 0.5 * 32 * 4) and tp_norm_allreduce(t, 1) == (0, 0.0)
    assert tp_norm_allreduce(t, 2, 4) == (5 / 4, 5 * 32 * 4 / 4)
    st = tp_bytes_per_step(t, 1, 4, 2, 4, micro_batches=3)
    assert st["calls"] == 3 * (15 + 10 + 1) + 5
    assert st["bytes"] == 3 * (b["all_gather"] + b["reduce_scatter"] + b["all_reduce"]) + 5 * 128
    # Topology: W 64, tp 8: dp_shard 8 across nodes, the node's 8 NICs shared by 8 groups: 50 GB/s.
    nd = FABRICS["nvlink+ndr"]
    tp8 = Topology(nd, 64, "fsdp", 8)
    assert tp8.shard_world() == 8 and tp8._link(8) == (50e9, nd.a_inter)
    assert Topology(nd, 8, "fsdp", 2)._link(4) == (450e9, nd.a_intra)
    assert Topology(nd, 64, "hsdp", 4).shard_world() == 2
    # Context parallelism (issue 41): tiny (KV = 2 x 8), B 1, T 8, cp 2, fp32, causal: Tl 4, a K or V
    # block 4 x 16 x 4 = 256 bytes, positions 16. ring: forward 1 x (2 x 256 + 16), backward the
    # same + 2 shifts of dK, dV (512 each); allgather: forward the same, backward + 1 x 2 x 256.
    r = cp_bytes_per_layer(t, 1, 8, 2, "ring", 4)
    assert (r["forward"], r["backward"], r["calls"]) == (528.0, 528.0 + 1024, 10)
    g = cp_bytes_per_layer(t, 1, 8, 2, "allgather", 4)
    assert (g["forward"], g["backward"], g["calls"], g["chunks"]) == (528.0, 528.0 + 512, 8, 1)
    assert cp_bytes_per_layer(t, 1, 8, 2, "ring", 4, doc=True)["bytes"] == r["bytes"] + 2 * 16
    assert cp_bytes_per_layer(t, 1, 8, 1, "ring", 4)["bytes"] == 0
    assert cp_bytes_per_step(t, 1, 8, 2, "ring", 4, micro_batches=3)["bytes"] == 3 * t.L * r["bytes"]
    # ring - allgather = 2 x a K/V block (the last dK/dV shift) at every cp; both ~ 6 B T KV e.
    for cp in (2, 4, 8):
        d = (cp_bytes_per_layer(c8, 1, 32768, cp, "ring", 2)["bytes"]
             - cp_bytes_per_layer(c8, 1, 32768, cp, "allgather", 2)["bytes"])
        assert d == 2 * (32768 // cp) * c8.KV * 2
    # llama-8b at 128K, cp 8: Tl 16384; all 8 heads gathered 1 GiB > 256 MiB; one head chunked with its
    # packed rows (32 + 4 + 12) x 16384 x 128 x 2 = 192 MiB: 1 head a chunk. At 32K all 8 fit (256 MiB).
    assert cp_gather_kv_heads(8, 16384, 32, 8, 128, 2) == 1
    assert cp_gather_kv_heads(8, 4096, 32, 8, 128, 2) == 8
    # The head-tail ring hides its transfers above KV e MFU peak / (2 Q B): llama-8b 139 rows at 25.3%.
    assert 138 < cp_ring_min_rows(c8, 0.253, 450e9) < 140
    # Expert parallelism (issue 56). Parameter counts as src/model/config.cpp states them.
    mx = load_moe_config("mixtral-8x7b")
    assert (mx.num_params(), mx.num_active_params()) == (46702792704, 12879925248)
    q3 = load_moe_config("qwen3-30b-a3b")
    assert (q3.num_params(), q3.num_active_params()) == (30532122624, 3353032704)
    ds = load_moe_config("deepseek-v3-mha")
    assert round(dsv3_mla_counts(ds)[0] / 1e9) == 671  # DeepSeek-V3's 671B with MLA in place of MHA
    # Units: every parameter once; with expert units an EP rank holds E / ep experts of each MoE layer.
    for cf in (mx, ds):
        assert sum(n for _, n, _ in moe_units(cf, expert_units=False)) == cf.num_params()
        assert sum(n for _, n, _ in moe_units(cf)) == cf.num_params()
        ex = (cf.L - cf.dense_layers) * cf.E * cf.expert_numel()
        assert sum(n for _, n, _ in moe_units(cf, ep=8)) == cf.num_params() - ex + ex // 8
    assert moe_units(mx, ep=8)[expert_unit_index(mx, 0)] == ("model.layers.0.mlp.experts", 3 * 4096 * 14336, "expert")
    for bad in ((mx, 1, 3), (mx, 1, 16), (ds, 1, 3)):
        try:
            check_moe(*bad)
            raise AssertionError("ep %d of %s accepted" % (bad[2], bad[0].name))
        except ValueError:
            pass
    # An all-to-all: tokens x k x C x e x (ep-1)/ep; mixtral, 4,096 tokens, ep 8, bf16: 58,720,256 bytes.
    assert ep_a2a_bytes(mx, 4096, 8) == 4096 * 2 * 4096 * 2 * 7 / 8 == 58720256
    assert ep_a2a_bytes(mx, 4096, 1) == 0 and ep_a2a_counts() == (2, 2, 1, 1) and ep_a2a_counts("full") == (2, 4, 1, 2)
    # Dense units' rings are Topology's; an expert unit's ring at ep x tp >= 8 has one NIC per GPU.
    for W, tp in ((64, 1), (64, 8), (8, 2), (1024, 4)):
        assert ep_link(nd, W // tp, tp) == Topology(nd, W, "fsdp", tp)._link(W // tp)
    assert ep_link(nd, 8, 8) == (50e9, nd.a_inter) and ep_link(nd, 2, 4) == (450e9, nd.a_intra)
    print("selftest: ok")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("plan", help="per-unit counts and bytes per step")
    sp.add_argument("--model", default="llama-1b")
    sp.add_argument("--world", type=int, default=8)
    sp.add_argument("--seq-len", type=int, default=SEQ)
    sp.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "bf16-rbf16", "bf16-noslab"])
    sp.add_argument("--tp", type=int, default=1, help="tensor-parallel size (W = dp x tp)")
    sp.add_argument("--micro-batch", type=int, default=8, help="sequences per TP group micro-batch (TP bytes)")
    sp.add_argument("--recompute", default="none", choices=list(RECOMPUTE), help="--activation-checkpointing (TP bytes)")
    sp.set_defaults(fn=cmd_plan)
    st = sub.add_parser("tables", help="the tables of docs/scaling.md")
    st.add_argument("--markdown", action="store_true")
    st.set_defaults(fn=cmd_tables)
    sc = sub.add_parser("check", help="predicted vs measured communication of CPU runs")
    sc.add_argument("--model", default="tests/bench/scaling-config.json", help="preset or config.json of the run")
    sc.add_argument("--metrics", action="append", default=[], help="--metrics JSONL of a run (repeat, with --world)")
    sc.add_argument("--world", action="append", type=int, default=[], help="its world size")
    sc.add_argument("--bandwidth-json", required=True, help="comm_bandwidth --json output (JSON lines)")
    sc.add_argument("--seq-len", type=int, default=256)
    sc.add_argument("--micro-batch", type=int, default=1, help="(reported; the collectives do not depend on it)")
    sc.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    sc.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "bf16-rbf16", "bf16-noslab"])
    sc.add_argument("--prefetch", type=int, default=1, help="prefetch depth of the run's --overlap on (0 = off)")
    sc.add_argument("--skip", type=int, default=2, help="step rows dropped at the start")
    sc.add_argument("--bench-stat", default="median", choices=["median", "min"],
                    help="which time of the bandwidth file: median (default) or minimum over repetitions")
    sc.set_defaults(fn=check)
    stp = sub.add_parser("tp-tables", help="tokens/s per GPU with tensor parallelism (docs/scaling.md)")
    stp.add_argument("--markdown", action="store_true")
    stp.set_defaults(fn=cmd_tp_tables)
    sq = sub.add_parser("predict-tp-cpu", help="predicted TP communication per step of a CPU run")
    sq.add_argument("--model", default="tests/bench/scaling-config.json", help="preset or config.json of the run")
    sq.add_argument("--bandwidth-json", required=True, help="comm_bandwidth --json output with a run at W = tp")
    sq.add_argument("--tp", type=int, default=2)
    sq.add_argument("--seq-len", type=int, default=256)
    sq.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch of the TP group")
    sq.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    sq.add_argument("--act-dtype", default="fp32", choices=["fp32", "bf16"], help="activation element type")
    sq.add_argument("--recompute", default="none", choices=list(RECOMPUTE))
    sq.add_argument("--loss-chunk", type=int, default=0, help="tokens per loss chunk (0 = default_loss_chunk(ceil(V / tp)))")
    sq.add_argument("--bench-stat", default="median", choices=["median", "min"])
    sq.set_defaults(fn=cmd_predict_tp_cpu)
    scp = sub.add_parser("cp-tables", help="context parallelism on NVLink: bytes per layer, exposed time (docs/scaling.md)")
    scp.add_argument("--markdown", action="store_true")
    scp.add_argument("--model", default="llama-8b")
    scp.set_defaults(fn=cmd_cp_tables)
    scb = sub.add_parser("cp-bytes", help="cp_bytes and cp_collectives per step of a run (as its metrics count them)")
    scb.add_argument("--model", default="tests/bench/cp-config.json", help="preset or config.json of the run")
    scb.add_argument("--cp", type=int, default=2)
    scb.add_argument("--method", default="", choices=["", "ring", "allgather"], help="default: both")
    scb.add_argument("--seq-len", type=int, default=16384)
    scb.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch of the CP group")
    scb.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    scb.add_argument("--tp", type=int, default=1)
    scb.add_argument("--act-dtype", default="fp32", choices=["fp32", "bf16"])
    scb.add_argument("--mask", default="causal", choices=["causal", "document"])
    scb.set_defaults(fn=cmd_cp_bytes)
    spp = sub.add_parser("pp-tables", help="pipeline parallelism: best mesh with and without PP (docs/scaling.md)")
    spp.add_argument("--markdown", action="store_true")
    spp.set_defaults(fn=cmd_pp_tables)
    sep = sub.add_parser("ep-tables", help="expert parallelism: best mesh with and without EP (docs/scaling.md)")
    sep.add_argument("--markdown", action="store_true")
    sep.set_defaults(fn=cmd_ep_tables)
    ss = sub.add_parser("selftest")
    ss.set_defaults(fn=lambda a: selftest())
    a = ap.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main()
