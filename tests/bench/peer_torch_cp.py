"""PyTorch's own context parallelism on the CPU: the would-be peer of shardtrain's --cp 2 (issue 41).

Usage (one process per rank; ranks from Open MPI's OMPI_COMM_WORLD_RANK/SIZE or torchrun's
RANK/WORLD_SIZE):
  mpirun -np 2 .venv/bin/python tests/bench/peer_torch_cp.py --model tests/bench/demo-config.json \
      --seq-len 64 --batch 2 --steps 20 --threads 1

What it runs: transformers' LlamaForCausalLM from the config (sdpa attention, fp32, default
init, no FSDP: parameters replicated), every rank of a gloo group of W ranks is one CP rank
(device mesh ("cp",) of size W on "cpu"); each step, inside
torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[input_ids, labels,
position_ids], buffer_seq_dims=[1, 1, 1]) (the context manager shards the buffers' sequence
dimension in place, head-tail as shardtrain's split when load balancing is on), the model's
forward (causal, labels shifted by transformers) and backward, then AdamW. Tokens are random
(seeded), B sequences of T tokens per step shared by the CP group: tokens/s = B·T / step time,
the mean over steps after the first two, printed by rank 0 as "tokens/s N".

On the CPU it does not run (torch 2.15.0, the venv's): context parallelism replaces only the
CUDA attention operators (aten._scaled_dot_product_{flash,efficient,cudnn}_attention and their
backwards; torch/distributed/tensor/experimental/_context_parallel/_attention.py), and the CPU's
SDPA, aten._scaled_dot_product_flash_attention_for_cpu, then reaches DTensor without a sharding
rule. The script catches that error, prints "error: <type>: <message>" and the torch version on
rank 0, and exits with status 2, so that throughput.py can show the refusal in place of a peer.

--device cuda (tests/gpu/run.sh stage 3c, the GPU peer of --cp 2): NCCL, each rank on GPU
rank % device count, the model in bf16 (the flash SDPA operator CP replaces). On one GPU, two
ranks share it, which NCCL may refuse; any such error is caught and printed the same way.
"""
import argparse
import os
import sys
import time

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--model", required=True, help="Hugging Face config.json of a LlamaForCausalLM")
p.add_argument("--seq-len", type=int, default=64, help="T, divisible by 2 x world size")
p.add_argument("--batch", type=int, default=2, help="sequences per step (the CP group's shared batch)")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--port", type=int, default=29521)
p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, bf16 (see above)")
ARGS = p.parse_args()
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.experimental import context_parallel  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def main():
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", 0)))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    T, B = ARGS.seq_len, ARGS.batch
    if T % (2 * world):
        print(f"error: --seq-len {T} is not divisible by 2 x world size = {2 * world}", file=sys.stderr)
        return 1
    torch.set_num_threads(ARGS.threads)
    cuda = ARGS.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    times = []
    try:
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{ARGS.port}", rank=rank, world_size=world)
        mesh = init_device_mesh(ARGS.device, (world,), mesh_dim_names=("cp",))
        cfg = LlamaConfig.from_json_file(ARGS.model)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(1337)
        model = LlamaForCausalLM(cfg)
        if cuda:
            model = model.to(device="cuda", dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(7)
        for _ in range(ARGS.steps):
            ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen).to(ARGS.device)
            labels = ids.clone()
            pos = torch.arange(T).unsqueeze(0).expand(B, T).contiguous().to(ARGS.device)
            dist.barrier()
            t0 = time.perf_counter()
            with context_parallel(mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1]):
                loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    except Exception as e:  # the refusal on the CPU (see the docstring), or NCCL's on one GPU
        if rank == 0:
            msg = str(e).strip().splitlines()
            print(f"error: {type(e).__name__}: {msg[-1] if msg else ''}")
            print(f"torch {torch.__version__}, {backend}, world {world}, cp {world}, T {T}")
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    if rank == 0:
        timed = times[2:] or times
        print(f"tokens/s {B * T * len(timed) / sum(timed):.1f} (torch {torch.__version__}, {ARGS.device}, cp {world}, "
              f"T {T}, B {B}, loss {loss.item():.4f})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
