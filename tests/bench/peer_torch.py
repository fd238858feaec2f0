"""The PyTorch peer of shardtrain for make bench: the same training run in PyTorch FSDP2 on CPU.

Usage (one process per rank; ranks from Open MPI's OMPI_COMM_WORLD_RANK/SIZE, torchrun's
RANK/WORLD_SIZE, or a single rank):
  mpirun -np 2 .venv/bin/python tests/bench/peer_torch.py --model CONFIG.json --data X.tok \
      --seq-len 64 --global-batch 12 --steps 300 --threads 1 [--compile] [--metrics FILE] ...
The options are shardtrain's, with its defaults and meanings (src/app/options.cpp), so that
tests/bench/throughput.py can give both programs the same command-line tail.

What it trains, and why it is the same run as shardtrain's:
* Model: transformers' LlamaForCausalLM (or MixtralForCausalLM, its fused experts on grouped_mm,
  the load-balancing loss of each forward added with router_aux_loss_coef: shardtrain's
  --aux-loss-scope micro-batch; the logged loss is the cross-entropy, as shardtrain's step line)
  built from the same config.json (sdpa attention, no KV
  cache), fp32. Parameters are created on the meta device, sharded with FSDP2 (fully_shard on
  each decoder layer, then on the whole model, gloo process group over 127.0.0.1), and only
  then materialised: a rank never holds more than its shards plus the layers it is gathering,
  as with shardtrain. Their values are shardtrain's init exactly (src/shard/sharded_state.cpp: every
  matrix element is counter_normal(seed, fnv1a64(name), flat index) * initializer_range,
  norm weights 1; tied embeddings), computed here in numpy for each rank's own rows.
* Data: shardtrain's token file (docs/data-format.md) and its batches exactly
  (src/data/data.cpp fill_batch): sequence i of global batch k starts at
  mix(seed ^ mix(stream ^ mix(k * 0x100000001b3 + i))) mod (n_train - T); rank r of W takes
  sequences [r*G/W, (r+1)*G/W). So step k sees the same tokens in both programs.
* Loss: mean cross-entropy of the rank's tokens; FSDP2's reduce-scatter averages the gradients
  over ranks, so the update follows the mean over the global batch, as shardtrain's.
* Optimiser: torch.optim.AdamW (betas, eps, decoupled weight decay; no decay on the 1-D norm
  weights, as shardtrain), learning rate set every step by shardtrain's lr_at (linear warm-up
  (s+1)/warmup, then cosine to min-lr over steps - warmup; src/train/train.cpp), gradients
  scaled by clip/norm when their global L2 norm exceeds clip.
* --compile: each decoder layer's forward and the loss are compiled with torch.compile (default
  mode; the FSDP2 hooks stay outside the compiled code, as torchtitan does); compilation happens
  in the first step(s), before the timed window.

What it reports: rank 0 prints shardtrain's step lines ("step N/M | loss ... | tok/s | s") every
--log-every steps, on the first and the last, and writes the same JSON-lines metrics rows
(step, loss, lr, grad_norm, tokens_per_s, elapsed_s; elapsed_s counts from just before the first
step, after the set-up), so that one summariser reads both programs. At the end rank 0 prints
every rank's peak RSS (getrusage ru_maxrss) and CPU seconds. The loss is all-reduced only on
logged steps (shardtrain reduces it every step along with the gradient norm). No evaluation.
AdamW runs with foreach=True (fused=True measured the same here, within the noise).
Checkpoints (the peer of tests/bench/checkpoint.py): with --checkpoint-dir and --checkpoint-every
N, after every N-th step (not the last) the model's and AdamW's state dicts (the FSDP2 shards,
get_model_state_dict / get_optimizer_state_dict) are saved with torch.distributed.checkpoint to
DIR/step_N: --checkpoint-async off: dcp.save (FileSystemWriter, its default sync_files=True:
every file fsynced); on: dcp.async_save (the state staged to CPU memory, then written by a
thread) on a gloo process group of its own, as torchtitan does, at most one in flight (the next
save and the end of the run wait for it). Rank 0 logs each save in shardtrain's words, so that
checkpoint.py reads both programs' logs with one set of patterns: off, "checkpoint: saved ... in
T s, R MB/s (training blocked T s: snapshot 0.00 s, write T s)"; on, "checkpoint: step N:
snapshot taken in S s, writing in the background (training blocked B s)" and, once its future is
done, "... in the background: write W s, R MB/s; steps A-B ran meanwhile" (W from the call to
the future's completion, by a done-callback). MB: parameters + both moments, 12 bytes per
parameter, as shardtrain counts them.
"""
import argparse
import json
import math
import os
import resource
import sys
import time

import numpy as np


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face config.json of a LlamaForCausalLM")
    p.add_argument("--data", required=True, help="token file made by shardtrain --mode prepare")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=12)
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
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer and the loss")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism over all ranks (world size = TP, no data parallelism): "
                        "parallelize_module with torchtitan's Llama plan instead of FSDP2")
    p.add_argument("--port", type=int, default=29511, help="TCP port of the gloo rendezvous on 127.0.0.1")
    # shardtrain options that mean nothing here, accepted so both programs take the same tail.
    p.add_argument("--checkpoint-dir", default="", help="torch.distributed.checkpoint (DCP) saves go here")
    p.add_argument("--checkpoint-every", type=int, default=0, help="a DCP save of model + AdamW state every N steps")
    p.add_argument("--checkpoint-async", choices=("on", "off"), default="on",
                   help="on: dcp.async_save (a staged CPU copy, written by a thread, on a gloo group of its own); "
                        "off: dcp.save")
    p.add_argument("--eval-every", type=int, default=0, help="ignored (no evaluation)")
    p.add_argument("--eval-batches", type=int, default=0, help="ignored (no evaluation)")
    return p.parse_args()


ARGS = parse_args()
# Thread pools are sized when torch is imported: set them first (OpenMP and MKL, the BLAS of
# PyPI's torch), then again through torch below.
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,  # noqa: E402
                                               SequenceParallel, parallelize_module)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict  # noqa: E402

MASK = (1 << 64) - 1


# ---- shardtrain's counter-based random numbers (src/data/data.cpp mix, src/shard/sharded_state.cpp) ----
def mix(x):
    """SplitMix64 finaliser of one Python int (shardtrain's mix / splitmix64)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def mix_np(x):
    """The same on a numpy uint64 array (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def fnv1a64(s):
    h = 1469598103934665603
    for c in s.encode():
        h = ((h ^ c) * 1099511628211) & MASK
    return h


def counter_normal(seed, key, first, count):
    """counter_normal(seed, key, i) for i in [first, first + count): SplitMix64 + Box-Muller."""
    return counter_normal_at(seed, key, np.arange(first, first + count, dtype=np.uint64))


def counter_normal_at(seed, key, i):
    """counter_normal(seed, key, i) for each flat index of the uint64 array i."""
    s, k = np.uint64(seed), np.uint64(key)
    a = mix_np(s ^ mix_np(k ^ mix_np(np.uint64(2) * i)))
    b = mix_np(s ^ mix_np(k ^ mix_np(np.uint64(2) * i + np.uint64(1))))
    u1 = ((a >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
    u2 = (b >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def read_token_file(path):
    """The training split of a shardtrain token file (docs/data-format.md)."""
    head = np.fromfile(path, dtype="<u8", count=8)
    if bytes(head[:1].tobytes()) != b"STTOKv1\0":
        sys.exit(f"peer_torch: {path}: not a shardtrain token file")
    n_train = int(head[4])
    token_bytes = int(np.fromfile(path, dtype="<u4", count=7)[6])  # 2 (u16) or 4 (u32)
    return np.fromfile(path, dtype="<u2" if token_bytes == 2 else "<u4", offset=64, count=n_train)


def train_batch(train, seed, index, first, count, T):
    """Sequences [first, first + count) of global training batch `index` (fill_batch)."""
    span = len(train) - T
    stream = 0x7472616E  # "tran"; validation uses 0x76616c
    offs = [mix(seed ^ mix(stream ^ mix((index * 0x100000001B3 + first + s) & MASK))) % span for s in range(count)]
    win = np.asarray(offs, dtype=np.int64)[:, None] + np.arange(T + 1, dtype=np.int64)[None, :]
    seq = torch.from_numpy(train[win].astype(np.int64))
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def lr_at(a, s):
    """shardtrain's schedule (src/train/train.cpp lr_at), step s 0-based."""
    if s < a.warmup:
        return a.lr * (s + 1) / a.warmup
    decay = max(1, a.steps - a.warmup)
    p = min(1.0, (s - a.warmup) / decay)
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * p)) * (a.lr - a.min_lr)


def rank_and_world():
    for r, w in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("RANK", "WORLD_SIZE")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[w])
    return 0, 1


@torch.no_grad()
def init_like_shardtrain(model, cfg, seed):
    """Fills each rank's shards with shardtrain's initial values (see the module docstring)."""
    chunk = 1 << 20
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if p.dim() == 1:  # RMSNorm weights
            local.fill_(1.0)
            continue
        shape, offset = (compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                         if isinstance(p, DTensor) else (tuple(p.shape), (0,) * p.dim()))
        assert tuple(shape) == tuple(local.shape), (name, shape, offset)
        # A Mixtral block's fused experts [E, 2I, C] / [E, C, I] (FSDP2 shards dim 0): shardtrain's
        # flat index runs over the whole tensor, row-major, as for a matrix of E rows.
        assert p.dim() == 2 or (all(o == 0 for o in offset[1:]) and tuple(shape[1:]) == tuple(p.shape[1:])), name
        cols = int(np.prod(p.shape[1:]))
        key = fnv1a64(name)
        if p.dim() == 2 and (offset[1] != 0 or shape[1] != cols):  # a block of columns (--tp: RowwiseParallel's Shard(1))
            r = np.arange(offset[0], offset[0] + shape[0], dtype=np.uint64)[:, None]
            c = np.arange(offset[1], offset[1] + shape[1], dtype=np.uint64)[None, :]
            v = cfg.initializer_range * counter_normal_at(seed, key, (r * np.uint64(cols) + c).reshape(-1))
            local.copy_(torch.from_numpy(v.astype(np.float32)).view(local.shape))
            continue
        flat = local.view(-1)
        first = offset[0] * cols
        for lo in range(0, flat.numel(), chunk):
            n = min(chunk, flat.numel() - lo)
            v = cfg.initializer_range * counter_normal(seed, key, first + lo, n)
            flat[lo:lo + n].copy_(torch.from_numpy(v.astype(np.float32)))


def parallelize_tp(model, mesh):
    """--tp: Megatron-style TP with sequence parallelism over the 1-D mesh, torchtitan's Llama plan
    (torchtitan/models/llama3/infra/parallelize.py apply_tp, without loss parallelism) on
    transformers' module names. Between blocks the residual stream is sharded over the sequence
    (Shard(1)); each block's input is all-gathered before q/k/v and gate/up (ColwiseParallel:
    weights split by output features, i.e. by heads and by SwiGLU columns) and reduce-scattered
    after o/down (RowwiseParallel: split by input features). The norms run on their sequence
    shard (SequenceParallel, weights replicated, gradients all-reduced). The embedding is split by
    vocabulary rows (RowwiseParallel, output reduce-scattered to Shard(1)); the head by vocabulary
    columns (ColwiseParallel), its logits all-gathered to every rank (Replicate), so the loss is the
    plain cross-entropy over the whole batch on each rank."""
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    # The plan gave the embedding and the head a DTensor each: tie them again (both Shard(0)).
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def tp_logits(model, tokens):
    """LlamaForCausalLM's forward under --tp. LlamaModel.forward takes the sequence length from the
    embedding's output, which is the rank's sequence shard here; so this runs its steps itself with
    the whole sequence's RoPE positions: embedding, decoder layers (no mask: sdpa's causal path, as
    in the FSDP2 run), final norm, head. Returns the [B, T, V] logits, the same on every rank."""
    m = model.model
    h = m.embed_tokens(tokens)  # this rank's sequence shard, [B, T / tp, C]
    pos = torch.arange(tokens.shape[1], dtype=torch.long).unsqueeze(0)
    rope = m.rotary_emb(h, pos)
    for layer in m.layers:
        h = layer(h, position_embeddings=rope)
    return model.lm_head(m.norm(h))


class Checkpointer:
    """DCP saves every --checkpoint-every steps; see the module's docstring."""

    def __init__(self, a, rank, model, opt, n_params):
        self.a, self.rank, self.model, self.opt = a, rank, model, opt
        self.mb = 12 * n_params / 1e6  # parameters + AdamW's two moments, fp32
        self.async_ = a.checkpoint_async == "on"
        self.group = dist.new_group(backend="gloo") if self.async_ else None
        self.fut, self.fut_step, self.t_call, self.t_done = None, 0, 0.0, [0.0]

    def log(self, msg):
        if self.rank == 0:
            print(msg, flush=True)

    def collect(self, now_step, wait):
        if self.fut is None or (not wait and not self.fut.done()):
            return 0.0
        t0 = time.perf_counter()
        self.fut.result()
        waited = time.perf_counter() - t0
        w = self.t_done[0] - self.t_call
        self.log(f"checkpoint: saved '{self.path(self.fut_step)}' ({self.mb:.1f} MB of parameters + AdamW state) "
                 f"in the background: write {w:.2f} s, {self.mb / w:.0f} MB/s; steps {self.fut_step + 1}-{now_step} "
                 f"ran meanwhile")
        self.fut = None
        return waited

    def path(self, step):
        return os.path.join(self.a.checkpoint_dir, f"step_{step:08d}")

    def after_step(self, step, last):
        if self.async_:
            self.collect(step, wait=False)
        if step % self.a.checkpoint_every or last:
            return
        t0 = time.perf_counter()
        waited = self.collect(step, wait=True) if self.async_ else 0.0
        state = {"model": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, self.opt)}
        if self.async_:
            self.t_call = time.perf_counter()
            self.fut = dcp.async_save(state, checkpoint_id=self.path(step), process_group=self.group)
            self.t_done = [0.0]
            done = self.t_done
            self.fut.add_done_callback(lambda f: done.__setitem__(0, time.perf_counter()))
            self.fut_step = step
            b = time.perf_counter() - t0
            self.log(f"checkpoint: step {step}: snapshot taken in {b - waited:.2f} s, writing in the background "
                     f"(training blocked {b:.2f} s" + (f", of which {waited:.2f} s waiting" if waited > 0 else "") + ")")
        else:
            dcp.save(state, checkpoint_id=self.path(step))
            dist.barrier()
            t = time.perf_counter() - t0
            self.log(f"checkpoint: saved '{self.path(step)}' ({self.mb:.1f} MB of parameters + AdamW state) in "
                     f"{t:.2f} s, {self.mb / t:.0f} MB/s (training blocked {t:.2f} s: snapshot 0.00 s, write {t:.2f} s)")

    def finish(self):
        if self.async_:
            self.collect(self.a.steps, wait=True)


def main():
    a = ARGS
    t_proc = time.perf_counter()
    rank, world = rank_and_world()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    if a.tp > 1 and (a.tp != world or a.compile or a.seq_len % a.tp):
        sys.exit(f"peer_torch: --tp {a.tp} needs the world size ({world}) = TP, no --compile and --seq-len "
                 f"a multiple of TP")
    dp, dp_rank = world // a.tp, rank // a.tp  # with --tp every rank takes the whole batch
    if a.global_batch % dp:
        sys.exit(f"peer_torch: --global-batch {a.global_batch} is not divisible by the data-parallel size {dp}")
    per_rank = a.global_batch // dp

    with open(a.model) as f:
        raw = json.load(f)
    # A MixtralForCausalLM config (issue 56): transformers' model, its fused experts (grouped_mm,
    # its default), and the load-balancing loss of each forward call added with
    # router_aux_loss_coef (output_router_logits): shardtrain's --aux-loss-scope micro-batch.
    moe = (raw.get("architectures") or ["LlamaForCausalLM"])[0] == "MixtralForCausalLM"
    cfg = MixtralConfig(**raw) if moe else LlamaConfig(**raw)
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    if moe and a.tp > 1:
        sys.exit("peer_torch: --tp with a Mixtral config is not a peer of anything")
    with torch.device("meta"):
        model = (MixtralForCausalLM if moe else LlamaForCausalLM)(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight or not cfg.tie_word_embeddings
    if a.tp > 1:
        parallelize_tp(model, mesh)
    else:
        for layer in model.model.layers:
            if a.compile:
                layer.forward = torch.compile(layer.forward)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    # Buffers are not parameters: the RoPE frequencies were left on the meta device's promise.
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    if cfg.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        sys.exit("peer_torch: tied embeddings came untied in to_empty")
    init_like_shardtrain(model, cfg, a.seed)
    model.train()

    def loss_of(logits, targets):
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    loss_fn = torch.compile(loss_of) if a.compile else loss_of

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.adam_eps, foreach=True)
    params = decay + no_decay
    train = read_token_file(a.data)
    if len(train) < a.seq_len + 1:
        sys.exit(f"peer_torch: the train split of {a.data} is shorter than one sequence")
    metrics = open(a.metrics, "w") if (rank == 0 and a.metrics) else None
    tokens_per_step = a.global_batch * a.seq_len
    n_params = sum(p.numel() for p in params)
    if rank == 0:
        print(f"peer_torch: torch {torch.__version__}, {world} rank(s), {a.threads} thread(s) per rank, "
              f"{'torch.compile' if a.compile else 'eager'}, {f'TP {a.tp} (parallelize_module)' if a.tp > 1 else 'FSDP2'}, {n_params} parameters, global batch "
              f"{a.global_batch} x {a.seq_len} tokens; set-up {time.perf_counter() - t_proc:.1f} s", flush=True)

    ck = Checkpointer(a, rank, model, opt, n_params) if (a.checkpoint_dir and a.checkpoint_every > 0) else None
    t_start = time.perf_counter()
    interval_s, interval_steps, first_step_s = 0.0, 0, 0.0
    for s in range(a.steps):
        t0 = time.perf_counter()
        tokens, targets = train_batch(train, a.seed, s, dp_rank * per_rank, per_rank, a.seq_len)
        if moe:
            out = model(input_ids=tokens, output_router_logits=True)
            ce = loss_fn(out.logits, targets)  # logged, as shardtrain's step line (aux apart)
            loss = ce + cfg.router_aux_loss_coef * out.aux_loss
        else:
            logits = tp_logits(model, tokens) if a.tp > 1 else model(input_ids=tokens).logits
            loss = ce = loss_fn(logits, targets)
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        gnorm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if not math.isfinite(gnorm):
            sys.exit(f"peer_torch: non-finite gradient norm at step {s + 1}")
        if a.clip > 0 and gnorm > a.clip:
            torch._foreach_mul_(grads, a.clip / gnorm)
        lr = lr_at(a, s)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        logged = (s + 1) % a.log_every == 0 or s + 1 == a.steps or s == 0
        if logged:  # global mean loss: a collective, so every rank takes part
            lsum = ce.detach().clone()
            dist.all_reduce(lsum)
            loss_g = float(lsum) / world
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
        if ck:
            ck.after_step(s + 1, last=(s + 1 == a.steps))
    if ck:
        ck.finish()
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
