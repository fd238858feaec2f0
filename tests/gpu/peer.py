#!/usr/bin/env python3
"""The PyTorch peer of shardtrain's GPU benchmark (tests/gpu/run.sh stage 5c).

Trains transformers' LlamaForCausalLM built from the config.json that shardtrain itself resolved
(`shardtrain --mode plan --model PRESET --out config.json`), the way a PyTorch user would on one GPU:
fp32 parameters, bf16 autocast, attn_implementation="sdpa" (PyTorch picks FlashAttention or cuDNN
attention), torch.compile on the model (--compile), torch.optim.AdamW(fused=True). Same global batch
and sequence length as the shardtrain row it is compared with; random token ids (the speed does not
depend on them). No gradient clipping: shardtrain's bench clips at 1.0, which costs one norm pass.

Prints one line
  PEER tokens_per_s=<mean of steps 3..N> min=<> max=<> peak_gib=<torch.cuda.max_memory_reserved>
       compile=<on|off> compile_s=<time of step 1> loss=<first>-><last> steps=<N>
and exits 0; any failure exits non-zero with the exception. --device cpu runs on the CPU in fp32
autocast-free form (a test of this script; numbers meaningless).
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="Hugging Face config.json (shardtrain --mode plan --out)")
    ap.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    ap.add_argument("--batch", type=int, required=True, help="sequences per step")
    ap.add_argument("--steps", type=int, default=12, help="steps; tokens/s is the mean of steps 3..steps")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args()
    if a.steps < 3:
        sys.exit("peer.py: --steps must be at least 3 (tokens/s is the mean of steps 3..steps)")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.load(open(a.config))
    # The special ids do not matter for training speed; transformers rejects null in some versions.
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(k) is None:
            cfg.pop(k, None)
    config = LlamaConfig(**cfg)
    config.use_cache = False
    dev = torch.device(a.device)
    torch.manual_seed(1337)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).to(dev)
    model.train()
    fused = a.device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused)
    fwd = torch.compile(model) if a.compile else model
    gen = torch.Generator(device="cpu").manual_seed(7)
    vocab = config.vocab_size
    autocast = torch.autocast(device_type=a.device, dtype=torch.bfloat16, enabled=a.device == "cuda")

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    tps, losses, first_s = [], [], None
    for step in range(1, a.steps + 1):
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=gen).to(dev, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        with autocast:
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if step == 1:
            first_s = dt
        if step >= 3:
            tps.append(a.batch * a.seq / dt)
    peak = torch.cuda.max_memory_reserved() / 2**30 if a.device == "cuda" else float("nan")
    print(f"PEER tokens_per_s={sum(tps) / len(tps):.0f} min={min(tps):.0f} max={max(tps):.0f} peak_gib={peak:.1f} "
          f"compile={'on' if a.compile else 'off'} compile_s={first_s:.1f} loss={losses[0]:.3f}->{losses[-1]:.3f} "
          f"steps={a.steps} torch={torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
