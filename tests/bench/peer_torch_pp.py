"""The PyTorch pipeline-parallel peer of shardtrain (issue 42): tests/bench/peer_torch.py's training run
with torch.distributed.pipelining (PipelineStage + ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B) on gloo, CPU.

Usage (one process per rank, world W = pipeline ranks; ranks as in peer_torch.py):
  mpirun -np 2 .venv/bin/python tests/bench/peer_torch_pp.py --model tests/bench/demo-config.json \
      --data build/data/fortunes.tok --seq-len 64 --global-batch 12 --micro-batch 3 --steps 20 \
      --pp 2 --pp-schedule 1f1b|gpipe|interleaved [--pp-virtual 2] [--pp-layers 1,1,1,1] [--metrics FILE]
The options are shardtrain's (src/app/options.cpp and the lead's --pp options), so that
tests/bench/throughput.py gives both programs one command-line tail. --pp defaults to the world
size and must equal it (no data parallelism); --micro-batch (default: the whole global batch, one
micro-batch) sets m = global-batch / micro-batch micro-batches per step.

What it runs, and why it is the same run as shardtrain's (and peer_torch.py's):
* Split: the L decoder layers are cut into S = W x V chunks (V = --pp-virtual, interleaved only)
  by pipeline_split below, a transcription of shardtrain's (src/parallel/pipeline_schedule.cpp):
  the embedding and the head each count as one layer, L + 2 layers evenly with the earlier chunks
  taking the remainder (each chunk with too few layers for that gets one block, the rest to the
  chunk with the fewest, earliest first); --pp-layers a,b,... by hand. Chunk c runs on rank
  c mod W (Megatron's and torch's interleaved placement); chunk 0 holds the embedding, chunk S - 1
  the final norm and the head. Each chunk is built as torchtitan's pipeline_llama_manual_split does:
  the whole LlamaForCausalLM on the meta device, the layers outside the chunk deleted (the
  remaining ones kept under their global index, an nn.ModuleDict, so parameter names are the
  whole model's), the embedding / norm / head set to None where the chunk does not hold them; then
  materialised and filled with shardtrain's init (peer_torch.init_like_shardtrain: counter_normal
  per parameter name), so every parameter has the value it has in the unsplit model. A chunk's
  forward: embedding (first) or the received hidden state, RoPE of positions 0..T-1, its decoder
  layers (sdpa, causal, no mask, as peer_torch.py), norm and head (last): logits.
* Tied embeddings (demo and gemm configs tie them): the first and the last chunk each hold a copy of
  the embedding / head matrix, initialised alike (the name of the tied weight,
  model.embed_tokens.weight); after each step's backward the two copies' gradients are summed (an
  all-reduce over the group {rank 0, rank W - 1}, or a local sum when one rank holds both), so that
  both get the gradient of the one tied weight, and the two copies, given the same gradients and
  AdamW state, stay equal (Megatron-LM's embedding group). torch.distributed.pipelining does not
  do this itself (a stage knows only its own module), but leaves the gradients to the caller after
  step(), so nothing stopped it.
* Data: peer_torch.train_batch, the whole global batch of step k (shardtrain's fill_batch), fed
  to the first stage's step(); the schedule cuts it into m micro-batches along the batch
  dimension (torch.tensor_split: micro-batch i = sequences [i*mb, (i+1)*mb), shardtrain's
  order). The last stage gets the targets.
* Loss: loss_fn is the mean cross-entropy of one micro-batch; the schedule's scale_grads (its
  default) divides the accumulated gradients by m, so they are the gradients of the mean over all
  the step's tokens (micro-batches have equal token counts), as shardtrain's. The logged loss is
  the mean of the m micro-batch losses on the last stage's rank, broadcast to rank 0.
* Clipping: the global L2 norm over every stage's gradients: each rank's sum of squares (the
  tied head copy left out, so the tied weight counts once), all-reduced over the world, square
  root (torchtitan#596: clipping each stage by its own norm was the bug). Then AdamW (foreach,
  no decay on 1-D weights) and lr_at, all from peer_torch.py.
* Output: rank 0 prints peer_torch.py's step lines and --metrics JSON rows (step, loss, lr,
  grad_norm, tokens_per_s, elapsed_s) and its "done:" line (peak RSS and CPU seconds per rank).
  No evaluation, no checkpoints, no --compile (their options are accepted and ignored).

Validated by tests/bench/pp_losses.py (fortunes corpus, seq-len 64, global batch 12, micro-batch 3,
20 steps, warm-up 5; every step's loss against shardtrain's own run of the job at 1 rank without
pipelining, worst relative difference over the 20 steps): demo-config (4 layers, tied) 1f1b, gpipe
and interleaved (2 x 2 chunks of 1 block) 1.1e-7, peer_torch.py's FSDP2 at 1 rank (the control)
1.5e-7; an untied 6-layer demo 1.0e-7 (interleaved split [1, 2, 2, 1]); gemm-config (8 layers,
tied) 1.0e-6 for all three schedules and the control (interleaved split [2, 3, 2, 1]). Also
--pp-layers 3,1 and W = 1 (one chunk; interleaved with 2) at 1.1e-7. Without the tied gradients'
sum, step 2 already differs by 1e-3 and step 20 by 0.7%: the check sees it. pipeline_split gives
shardtrain's bounds for every L <= 40, S <= 16 (compared with the C++ function's output).

torch 2.15.0 (the venv's), transformers 5.24.0. Refused by this script, as by shardtrain:
interleaved with V < 2 or m not a multiple of W (torch's ScheduleInterleaved1F1B would run any m
with m % max(1, m // W) == 0), V > 1 with another schedule, more chunks than layers, --pp other
than the world size. torch.distributed.pipelining refused nothing this script needs.
"""
import argparse
import json
import math
import os
import resource
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face config.json of a LlamaForCausalLM")
    p.add_argument("--data", required=True, help="token file made by shardtrain --mode prepare")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per micro-batch; 0 = the global batch")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--metrics", default="", help="JSON-lines metrics file written by rank 0")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (torch.set_num_threads)")
    p.add_argument("--pp", type=int, default=0, help="pipeline ranks; 0 = the world size (must equal it)")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b")
    p.add_argument("--pp-virtual", type=int, default=1, help="chunks per rank (interleaved: at least 2)")
    p.add_argument("--pp-layers", default="", help="decoder layers of each chunk, comma-separated, in model order")
    p.add_argument("--port", type=int, default=29531, help="TCP port of the gloo rendezvous on 127.0.0.1")
    for opt in ("--eval-every", "--eval-batches", "--checkpoint-every"):  # accepted, so the tails match
        p.add_argument(opt, type=int, default=0, help="ignored")
    p.add_argument("--checkpoint-dir", default="", help="ignored")
    p.add_argument("--checkpoint-async", default="on", help="ignored")
    return p.parse_args()


ARGS = parse_args()
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

# peer_torch.py parses its own command line when imported: give it one it accepts.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
_argv, sys.argv = sys.argv, ["peer_torch.py", "--model", ARGS.model, "--data", ARGS.data, "--threads", str(ARGS.threads)]
import peer_torch as base  # noqa: E402
sys.argv = _argv

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,  # noqa: E402
                                          ScheduleInterleaved1F1B)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def pipeline_split(layers, chunks, counts=()):
    """shardtrain's pipeline_split (src/parallel/pipeline_schedule.cpp): the S + 1 chunk bounds of
    `layers` blocks over `chunks` chunks; ValueError with shardtrain's message otherwise."""
    if chunks < 1:
        raise ValueError(f"pipeline: {chunks} model chunks (at least 1)")
    if chunks > layers:
        raise ValueError(f"pipeline: {chunks} model chunks for {layers} transformer blocks (at most one chunk per block)")
    if counts:
        if len(counts) != chunks:
            raise ValueError(f"--pp-layers: {len(counts)} counts for {chunks} model chunks")
        for c, k in enumerate(counts):
            if k < 1:
                raise ValueError(f"--pp-layers: chunk {c} has {k} blocks (at least 1)")
        if sum(counts) != layers:
            raise ValueError(f"--pp-layers: the counts sum to {sum(counts)}, the model has {layers} blocks")
        blocks = list(counts)
    else:  # L + 2 layers (embedding, blocks, head) evenly; earlier chunks take the remainder
        n = layers + 2
        blocks = [n // chunks + (c < n % chunks) - (c == 0) - (c == chunks - 1) for c in range(chunks)]
        if min(blocks) < 1:  # one block each, then each further block to the least loaded chunk, earliest first
            blocks = [1] * chunks
            load = [1 + (c == 0) + (c == chunks - 1) for c in range(chunks)]
            for _ in range(chunks, layers):
                c = load.index(min(load))
                blocks[c] += 1
                load[c] += 1
    bounds = [0]
    for k in blocks:
        bounds.append(bounds[-1] + k)
    return bounds


class LlamaChunk(nn.Module):
    """Decoder layers [lo, hi) of LlamaForCausalLM, with the embedding if first and the final norm
    and head if last; parameter names are the whole model's (model.layers.<global index>...)."""

    def __init__(self, cfg, lo, hi, first, last):
        super().__init__()
        with torch.device("meta"):
            full = LlamaForCausalLM(cfg)
        m = full.model
        m.layers = nn.ModuleDict({str(i): m.layers[i] for i in range(lo, hi)})
        if not first:
            m.embed_tokens = None
        if not last:
            m.norm = None
        self.model = m
        self.lm_head = full.lm_head if last else None

    def forward(self, x):
        m = self.model
        h = m.embed_tokens(x) if m.embed_tokens is not None else x
        rope = m.rotary_emb(h, torch.arange(h.shape[1], dtype=torch.long).unsqueeze(0))
        for layer in m.layers.values():
            h = layer(h, position_embeddings=rope)
        return self.lm_head(m.norm(h)) if self.lm_head is not None else h


class _Renamed:
    """A module's named_parameters with the tied head called by its tied name, for init_like_shardtrain."""

    def __init__(self, module, rename):
        self.module, self.rename = module, rename

    def named_parameters(self):
        return [(self.rename.get(n, n), p) for n, p in self.module.named_parameters()]


def build_chunk(cfg, c, S, bounds, seed):
    chunk = LlamaChunk(cfg, bounds[c], bounds[c + 1], c == 0, c == S - 1)
    tied = cfg.tie_word_embeddings and chunk.lm_head is not None
    both = tied and chunk.model.embed_tokens is not None  # S = 1: one chunk holds the tied weight twice
    if both and chunk.lm_head.weight is not chunk.model.embed_tokens.weight:
        sys.exit("peer_torch_pp: the config ties the embeddings but transformers' model does not")
    chunk.to_empty(device="cpu")  # gives each module its own tensor: tie them again
    if both:
        chunk.lm_head.weight = chunk.model.embed_tokens.weight
    chunk.model.rotary_emb = type(chunk.model.rotary_emb)(cfg)  # buffers: rebuilt, not left to to_empty
    base.init_like_shardtrain(_Renamed(chunk, {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}),
                              cfg, seed)
    chunk.train()
    return chunk


def fail(rank, msg):
    if rank == 0:
        print(f"peer_torch_pp: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def main():
    a = ARGS
    t_proc = time.perf_counter()
    rank, world = base.rank_and_world()
    torch.set_num_threads(a.threads)
    p = a.pp or world
    mb = a.micro_batch or a.global_batch
    if p != world:
        fail(rank, f"--pp {p} must equal the world size ({world}): no data parallelism here")
    if a.global_batch % mb:
        fail(rank, f"--global-batch {a.global_batch} is not divisible by --micro-batch {mb}")
    m = a.global_batch // mb
    v = a.pp_virtual
    name = f"--pp-schedule {a.pp_schedule}"
    if v < 1:
        fail(rank, f"--pp-virtual {v}: at least 1 chunk per rank")
    if a.pp_schedule != "interleaved" and v != 1:
        fail(rank, f"--pp-virtual {v} needs --pp-schedule interleaved ({name} runs one chunk per rank)")
    if a.pp_schedule == "interleaved" and v < 2:
        fail(rank, f"{name} needs --pp-virtual of at least 2 chunks per rank (got {v})")
    if a.pp_schedule == "interleaved" and m % p:
        fail(rank, f"{name}: {m} micro-batches per step is not a multiple of --pp {p} (the interleaved schedule "
                   "runs micro-batches in groups of p, as Megatron-LM requires)")
    with open(a.model) as f:
        cfg = LlamaConfig(**json.load(f))
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    S = p * v
    try:
        counts = [int(x) for x in a.pp_layers.split(",")] if a.pp_layers else []
        bounds = pipeline_split(cfg.num_hidden_layers, S, counts)
    except ValueError as e:
        fail(rank, str(e))

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=world)
    tie_group = dist.new_group([0, p - 1]) if (cfg.tie_word_embeddings and p > 1) else None
    mine = list(range(rank, S, p))  # chunk c on rank c mod p
    chunks = {c: build_chunk(cfg, c, S, bounds, a.seed) for c in mine}
    stages = [PipelineStage(chunks[c], c, S, torch.device("cpu")) for c in mine]

    def loss_fn(logits, targets):  # one micro-batch's mean; scale_grads divides the sum over micro-batches by m
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    if a.pp_schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
    else:
        sched = (ScheduleGPipe if a.pp_schedule == "gpipe" else Schedule1F1B)(stages[0], n_microbatches=m, loss_fn=loss_fn)

    # The tied weight's two copies (first chunk's embedding, last chunk's head), those this rank holds.
    embed = chunks[0].model.embed_tokens.weight if 0 in chunks else None
    head = chunks[S - 1].lm_head.weight if (S - 1) in chunks and cfg.tie_word_embeddings else None
    if head is not None and head is embed:  # one chunk holds both: one parameter
        embed = head = None
    params = [q for c in mine for q in chunks[c].parameters()]
    decay = [q for q in params if q.dim() >= 2]
    no_decay = [q for q in params if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.adam_eps, foreach=True)
    train = base.read_token_file(a.data)
    if len(train) < a.seq_len + 1:
        sys.exit(f"peer_torch_pp: the train split of {a.data} is shorter than one sequence")
    metrics = open(a.metrics, "w") if (rank == 0 and a.metrics) else None
    tokens_per_step = a.global_batch * a.seq_len
    n_local = sum(q.numel() for q in params) - (head.numel() if head is not None else 0)
    n_params = torch.tensor([float(n_local)], dtype=torch.float64)
    dist.all_reduce(n_params)
    if rank == 0:
        sched_name = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}[a.pp_schedule]
        print(f"peer_torch_pp: torch {torch.__version__}, {world} rank(s), {a.threads} thread(s) per rank, eager, "
              f"torch.distributed.pipelining {sched_name}, {S} chunk(s) ({v} per rank), blocks per chunk "
              f"{[bounds[c + 1] - bounds[c] for c in range(S)]}, {m} micro-batch(es) of {mb}, "
              f"{int(n_params)} parameters{' (tied embeddings: a copy on the first and the last chunk)' if cfg.tie_word_embeddings and S > 1 else ''}, "
              f"global batch {a.global_batch} x {a.seq_len} tokens; set-up {time.perf_counter() - t_proc:.1f} s", flush=True)

    t_start = time.perf_counter()
    interval_s, interval_steps, first_step_s = 0.0, 0, 0.0
    for s in range(a.steps):
        t0 = time.perf_counter()
        tokens, targets = base.train_batch(train, a.seed, s, 0, a.global_batch, a.seq_len)
        losses = []
        kw = dict(target=targets, losses=losses) if (S - 1) in chunks else {}
        if 0 in chunks:
            sched.step(tokens, return_outputs=False, **kw)
        else:
            sched.step(return_outputs=False, **kw)
        # Tied weight: both copies get the sum of their gradients.
        if embed is not None and head is not None:  # one rank holds both chunks (p = 1)
            g = embed.grad + head.grad
            embed.grad.copy_(g)
            head.grad.copy_(g)
        elif tie_group is not None and rank in (0, p - 1):
            dist.all_reduce((embed if rank == 0 else head).grad, group=tie_group)
        # Global gradient norm over all stages, the tied weight once.
        grads = [q.grad for q in params if q.grad is not None]
        counted = [q.grad for q in params if q.grad is not None and q is not head]
        sq = torch.nn.utils.get_total_norm(counted, 2.0, foreach=True).double() ** 2
        dist.all_reduce(sq)
        gnorm = float(sq.sqrt())
        if not math.isfinite(gnorm):
            sys.exit(f"peer_torch_pp: non-finite gradient norm at step {s + 1}")
        if a.clip > 0 and gnorm > a.clip:
            torch._foreach_mul_(grads, a.clip / gnorm)
        lr = base.lr_at(a, s)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        logged = (s + 1) % a.log_every == 0 or s + 1 == a.steps or s == 0
        if logged:  # the whole model's loss lives on the last chunk's rank (p - 1): a collective
            lt = torch.stack([x.detach() for x in losses]).mean().reshape(1) if losses else torch.zeros(1)
            dist.broadcast(lt, src=p - 1)
            loss_g = float(lt)
        dt = time.perf_counter() - t0
        interval_s += dt
        interval_steps += 1
        if s == 0:
            first_step_s = dt
        if logged:
            elapsed = time.perf_counter() - t_start
            tps = tokens_per_step * interval_steps / interval_s
            interval_s, interval_steps = 0.0, 0
            if rank == 0:
                print(f"step {s + 1}/{a.steps} | loss {loss_g:.4f} | lr {lr:.3e} | grad_norm {gnorm:.4f} | "
                      f"{tps:.0f} tok/s | {elapsed:.1f} s", flush=True)
                if metrics:
                    metrics.write(json.dumps({"step": s + 1, "loss": loss_g, "lr": lr, "grad_norm": gnorm,
                                              "tokens_per_s": tps, "elapsed_s": elapsed}) + "\n")
                    metrics.flush()
    train_s = time.perf_counter() - t_start
    ru = resource.getrusage(resource.RUSAGE_SELF)
    stats = torch.tensor([ru.ru_maxrss / 1024.0, ru.ru_utime + ru.ru_stime], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        print(f"done: {a.steps} steps in {train_s:.1f} s, {tokens_per_step * a.steps / train_s:.0f} tok/s "
              f"(first step {first_step_s:.1f} s); per rank peak RSS "
              + ", ".join(f"{g[0]:.1f}" for g in gathered) + " MiB, CPU "
              + ", ".join(f"{g[1]:.1f}" for g in gathered) + " s", flush=True)
        if metrics:
            metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
