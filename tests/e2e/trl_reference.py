"""TRL's SFTTrainer as the reference for shardtrain's instruction fine-tuning (issue 55): its
assistant masks, and the step losses of a short run, with TRL's own code (trl==1.16.0,
tests/requirements.txt), one process, CPU, fp32.

    python trl_reference.py model --tokenizer DIR --out HF [--seed S] [--max-positions N]
    python trl_reference.py masks --tokenizer DIR --data chat.jsonl --tok F.tok [--date-string D] [--show K]
    python trl_reference.py train --model-dir HF --tokenizer DIR --data chat.jsonl --steps 20 --batch B
                                  --accum A --lr X --out result.json [--date-string D] [--limit N] [--tok F.tok]

Example (fixtures of chat_make.py; the same --date-string as tokenize_hf.py, which llama3-gen needs):
    python tests/e2e/chat_make.py W
    python scripts/tokenize_hf.py --tokenizer W/llama3-gen --out W/llama3-gen.tok --date-string "26 Jul 2024" W/chat.jsonl
    python trl_reference.py masks --tokenizer W/llama3-gen --data W/chat.jsonl --tok W/llama3-gen.tok --date-string "26 Jul 2024"
    python trl_reference.py model --tokenizer W/llama3-gen --out W/hf-llama3-gen
    python trl_reference.py train --model-dir W/hf-llama3-gen --tokenizer W/llama3-gen --data W/chat.jsonl
        --tok W/llama3-gen.tok --limit 45 --steps 20 --batch 3 --accum 3 --lr 1e-3 --date-string "26 Jul 2024" --out W/trl.json
  (--limit 45: the file's training split; 45 = 5 steps of 3x3, so no epoch ends in a short step:
  with a count that the global batch does not divide, the epoch's last step has fewer examples.)

model: a tiny random LlamaForCausalLM (hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128,
  untied, RMSNorm eps 1e-5, RoPE theta 10000, seed fixed) whose vocabulary is the tokenizer's, saved
  with safetensors and the tokenizer's files copied in, for `shardtrain --mode import --hf-dir`.
  The default --max-positions is 1024, not 512: chat_make.py's longest conversation is 874 tokens
  (ChatML) / 940 (Llama-3), and shardtrain refuses a --seq-len above max_position_embeddings.
masks: builds SFTTrainer(assistant_only_loss=True, packing=False, max_length=None) on the JSONL and
  reads the dataset TRL prepared for training: input_ids and labels. TRL 1.16 folds the
  `assistant_masks` of apply_chat_template(return_assistant_tokens_mask=True) into `labels` (-100
  where the mask is 0) and drops the column, so TRL's mask is labels != -100. Asserted for every
  conversation against the version 3 file (read with scripts/shardtrain_tokens.py): the same ids,
  and mask == (role class != 0) token for token. The date string reaches TRL's tokenization the way
  TRL takes template arguments: a per-example `chat_template_kwargs` column.
train: SFTTrainer with assistant_only_loss=True, packing=False, train_sampling_strategy="sequential"
  (transformers 5's switch for a SequentialSampler; shuffle_dataset=False is TRL's own, the default),
  AdamW (torch) betas (0.9, 0.95) eps 1e-8, weight decay 0, constant LR without warmup, clipping at
  1.0, fp32 without gradient checkpointing, no truncation. The loss TRL logs per optimizer step is
  sum over micro-batches of (sum of the micro-batch's target-token NLL / num_items_in_batch), where
  transformers counts num_items_in_batch as labels[..., 1:] != -100 over all the step's
  micro-batches: the mean over the target tokens of the global batch. Checked here: a compute_loss
  wrapper counts the step's target tokens itself and asserts num_items_in_batch equals it, and sums
  the micro-batch losses in float64 ("losses_f64"; "losses" is what TRL logged, a float32 sum).
  "order" is read from the batches the model was fed (each row's unpadded ids looked up among the
  prepared examples), not assumed from the sampler. Indices are JSONL line numbers (blank lines
  skipped), which are the example indices of tokenize_hf.py's file; --limit N trains on the first N.
  --tok F.tok: step 1's loss recomputed from the token file before training (a plain forward of each
  example unpadded, targets role class != 0, float64), required within 1e-5 relative of TRL's: ties
  TRL's loss to the file shardtrain reads. result.json also has each step's grad_norm (before
  clipping) and target-token count.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_records(path, limit=None):
    recs = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return recs[:limit] if limit else recs


def make_dataset(recs, date_string):
    from datasets import Dataset
    rows = []
    for r in recs:
        if "messages" not in r:
            sys.exit("trl_reference.py: chat records ({\"messages\": [...]}) only")
        row = {"messages": r["messages"]}
        if date_string is not None:
            row["chat_template_kwargs"] = {"date_string": date_string}
        rows.append(row)
    return Dataset.from_list(rows)


def llama_config(tok, max_positions):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        attention_dropout=0.0, attention_bias=False, mlp_bias=False, hidden_act="silu",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def tiny_model(tok, seed, max_positions):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tok, max_positions)).float()


def sft_config(outdir, **kw):
    from trl import SFTConfig
    base = dict(output_dir=outdir, assistant_only_loss=True, packing=False, max_length=None, shuffle_dataset=False,
                train_sampling_strategy="sequential", bf16=False, fp16=False, activation_checkpointing=False,
                use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, dataloader_num_workers=0,
                dataset_num_proc=None, remove_unused_columns=True, disable_tqdm=True)
    base.update(kw)
    return SFTConfig(**base)


def cmd_model(a):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    model = tiny_model(tok, a.seed, a.max_positions)
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    for f in sorted(os.listdir(a.tokenizer)):
        if os.path.isfile(os.path.join(a.tokenizer, f)):
            shutil.copy(os.path.join(a.tokenizer, f), os.path.join(a.out, f))
    n = sum(p.numel() for p in model.parameters())
    print(f"trl_reference model: {a.out}: LlamaForCausalLM, vocab {len(tok)}, {n} parameters, seed {a.seed}, "
          f"max positions {a.max_positions}, tokenizer files of {a.tokenizer} copied in")


def decode_around(tok, ids, t, k=4):
    lo, hi = max(0, t - k), min(len(ids), t + k + 1)
    return " ".join(f"{'>' if i == t else ''}{tok.decode([ids[i]])!r}" for i in range(lo, hi)), lo, hi


def marked(tok, ids, mask):
    """The conversation's text with [[ ]] around the tokens of each mask run."""
    out, prev = [], 0
    for i, m in enumerate(list(mask) + [0]):
        if m != prev:
            out.append("[[" if m else "]]")
            prev = m
        if i < len(ids):
            out.append(tok.decode([ids[i]]))
    return "".join(out)


def cmd_masks(a):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import shardtrain_tokens as st
    from transformers import AutoTokenizer
    from trl import SFTTrainer
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    recs = load_records(a.data)
    with tempfile.TemporaryDirectory() as d:
        trainer = SFTTrainer(model=tiny_model(tok, 0, 4096), args=sft_config(d), train_dataset=make_dataset(recs, a.date_string),
                             processing_class=tok)
        ds = trainer.train_dataset
    if trainer.chat_template is not None:
        sys.exit("trl_reference.py masks: TRL swapped in its own training template (the tokenizer's has no "
                 "{% generation %} markers); give a -gen tokenizer")
    f = st.read_token_file(a.tok)
    if f["version"] != 3:
        sys.exit(f"trl_reference.py masks: {a.tok} is format version {f['version']}, not 3")
    toks = np.concatenate([np.asarray(f["train"]), np.asarray(f["val"])]).astype(np.int64)
    roles = np.asarray(f["roles"])
    bounds = list(np.asarray(f["starts"], dtype=np.int64)) + [len(toks)]
    if len(ds) != len(recs) or len(bounds) - 1 != len(recs):
        sys.exit(f"trl_reference.py masks: {len(recs)} conversations, TRL prepared {len(ds)}, the file has "
                 f"{len(bounds) - 1} examples")
    n_tok = n_mask = n_eot = 0
    for e in range(len(recs)):
        ids = list(ds[e]["input_ids"])
        mask = [int(x != -100) for x in ds[e]["labels"]]
        got = toks[bounds[e]: bounds[e + 1]].tolist()
        r = roles[bounds[e]: bounds[e + 1]].tolist()
        if ids != got:
            t = next((i for i in range(min(len(ids), len(got))) if ids[i] != got[i]), min(len(ids), len(got)))
            print(f"MISMATCH example {e}: ids differ at token {t} (TRL {len(ids)} tokens, file {len(got)})\n"
                  f"  TRL:  {decode_around(tok, ids, t)[0]}\n  file: {decode_around(tok, got, t)[0]}")
            return 1
        want = [int(x != 0) for x in r]
        if mask != want:
            t = next(i for i in range(len(mask)) if mask[i] != want[i])
            ctx, lo, hi = decode_around(tok, ids, t)
            print(f"MISMATCH example {e}: TRL's assistant mask differs from the role classes at token {t} of {len(ids)}\n"
                  f"  tokens:       {ctx}\n  TRL mask:     {mask[lo:hi]}\n  role classes: {r[lo:hi]}\n"
                  f"  (TRL masks {sum(mask)} tokens, the file {sum(want)})")
            return 1
        n_tok += len(ids)
        n_mask += sum(mask)
        n_eot += sum(1 for x in r if x == 2)
    if a.show is not None:
        e = a.show
        print(f"example {e}, TRL's mask as [[ ]]:\n{marked(tok, list(ds[e]['input_ids']), [int(x != -100) for x in ds[e]['labels']])}")
        r = roles[bounds[e]: bounds[e + 1]].tolist()
        ends = [tok.decode([toks[bounds[e] + i]]) for i, x in enumerate(r) if x == 2]
        print(f"role class 2 tokens of example {e}: {ends}")
    print(f"ok: TRL masks: {os.path.basename(a.tokenizer)}: {len(recs)} conversations, {n_tok} tokens: ids equal, "
          f"TRL's assistant mask == (role != 0) on every token ({n_mask} masked, {n_eot} of them end-of-turn class 2); "
          f"{time.time() - t0:.1f} s after imports")
    return 0


def first_step_loss(model, toks, roles, bounds, examples, index):
    """Sum of the next-token NLL over the target tokens (role class != 0, position > 0) of the given
    examples of the token file, each its own unpadded sequence, over their number: float64."""
    tot, n = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = toks[bounds[e]: bounds[e + 1]]
            if tuple(ids.tolist()) not in index:
                sys.exit(f"trl_reference.py train: example {e} of the token file is not among TRL's examples")
            tgt = torch.from_numpy(roles[bounds[e]: bounds[e + 1]] != 0)[1:]
            logits = model(input_ids=torch.from_numpy(ids)[None]).logits[0, :-1].double()
            nll = torch.nn.functional.cross_entropy(logits, torch.from_numpy(ids[1:]), reduction="none")
            tot += float(nll[tgt].sum())
            n += int(tgt.sum())
    return tot / n


def cmd_train(a):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import SFTTrainer
    t0 = time.time()
    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, local_files_only=True)
    recs = load_records(a.data, a.limit)
    check = None
    if a.tok:  # the first step's loss from the token file, before training changes the weights
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        import shardtrain_tokens as st
        f = st.read_token_file(a.tok)
        toks = np.concatenate([np.asarray(f["train"]), np.asarray(f["val"])]).astype(np.int64)
        roles, bounds = np.asarray(f["roles"]), list(np.asarray(f["starts"], dtype=np.int64)) + [len(toks)]
        check = (toks, roles, bounds)

    class Ref(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            if model.training:
                lab, am = inputs["labels"], inputs["attention_mask"]
                rows = [tuple(inputs["input_ids"][i, : int(am[i].sum())].tolist()) for i in range(lab.shape[0])]
                l = loss[0] if return_outputs else loss
                self.micro.append(dict(rows=rows, targets=int((lab[:, 1:] != -100).sum()),
                                       num_items=int(num_items_in_batch), loss=float(l.detach())))
            return loss

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            trainer.steps.append(trainer.micro)
            trainer.micro = []

    with tempfile.TemporaryDirectory() as d:
        args = sft_config(d, per_device_train_batch_size=a.batch, gradient_accumulation_steps=a.accum,
                          max_steps=a.steps, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
                          weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
                          optim="adamw_torch", seed=a.seed, data_seed=a.seed)
        trainer = Ref(model=model, args=args, train_dataset=make_dataset(recs, a.date_string), processing_class=tok,
                      callbacks=[StepEnd()])
        trainer.remove_callback(PrinterCallback)
        trainer.micro, trainer.steps = [], []
        ds = trainer.train_dataset
        index = {}
        for i in range(len(ds)):
            key = tuple(ds[i]["input_ids"])
            if key in index:
                sys.exit(f"trl_reference.py train: examples {index[key]} and {i} have the same ids; the order could "
                         "not be read back from the batches")
            index[key] = i
        longest = max(len(k) for k in index)
        step1 = None
        if check is not None:
            step1 = first_step_loss(model, *check, list(range(a.batch * a.accum)), index)
        t1 = time.time()
        trainer.train()
        t2 = time.time()
    logged = [h for h in trainer.state.log_history if "loss" in h and "step" in h and "train_runtime" not in h]
    if len(logged) != a.steps or len(trainer.steps) != a.steps:
        sys.exit(f"trl_reference.py train: {len(logged)} logged losses, {len(trainer.steps)} steps recorded, "
                 f"expected {a.steps}")
    losses_f64, order, targets = [], [], []
    for s, micro in enumerate(trainer.steps):
        n = sum(m["targets"] for m in micro)
        bad = [m["num_items"] for m in micro if m["num_items"] != n]
        if bad:
            sys.exit(f"trl_reference.py train: step {s + 1}: num_items_in_batch {bad[0]}, but the step's micro-batches "
                     f"have {n} target tokens")
        losses_f64.append(sum(m["loss"] for m in micro))
        order.append([index[r] for m in micro for r in m["rows"]])
        targets.append(n)
    losses = [float(h["loss"]) for h in logged]
    worst = max(abs(x - y) / abs(y) for x, y in zip(losses, losses_f64))
    note = ""
    if step1 is not None:
        if order[0] != list(range(a.batch * a.accum)):
            sys.exit(f"trl_reference.py train: step 1 trained on {order[0]}, not the first examples")
        rel = abs(losses[0] - step1) / step1
        note = f"; step 1 from {os.path.basename(a.tok)} (plain forward, role != 0): {step1:.6f}, {rel:.1e} relative"
        if rel > 1e-5:
            sys.exit(f"trl_reference.py train: step 1's loss {losses[0]!r} differs from the token file's {step1!r}{note}")
    result = {
        "losses": losses,
        "losses_f64": losses_f64,
        "grad_norm": [float(h["grad_norm"]) for h in logged],
        "target_tokens": targets,
        "order": order,
        "lr": a.lr,
        "step1_from_token_file": step1,
        "settings": {
            "trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
            "torch": torch.__version__, "model_dir": os.path.abspath(a.model_dir),
            "tokenizer": os.path.abspath(a.tokenizer), "data": os.path.abspath(a.data), "examples": len(recs),
            "longest_example": longest, "date_string": a.date_string, "steps": a.steps,
            "per_device_train_batch_size": a.batch, "gradient_accumulation_steps": a.accum,
            "global_batch": a.batch * a.accum, "seed": a.seed, "dtype": "float32", "processes": 1,
            "assistant_only_loss": True, "packing": False, "max_length": None, "shuffle_dataset": False,
            "train_sampling_strategy": "sequential", "optim": "adamw_torch", "adam_beta1": 0.9,
            "adam_beta2": 0.95, "adam_epsilon": 1e-8, "weight_decay": 0.0, "lr_scheduler_type": "constant",
            "warmup_steps": 0, "max_grad_norm": 1.0, "activation_checkpointing": False,
            "loss": "per optimizer step: sum of target-token NLL over the global batch / its target tokens "
                    "(labels[..., 1:] != -100); 'losses' as TRL logged it (float32), 'losses_f64' the same "
                    "micro-batch losses summed in float64",
        },
    }
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, a.out)
    print(f"trl_reference train: {a.steps} steps, global batch {a.batch}x{a.accum}, lr {a.lr}: losses "
          f"{losses[0]:.6f} .. {losses[-1]:.6f} (logged vs float64 sum: {worst:.1e} relative at most); "
          f"order of step 1 {order[0]}{note}; setup {t1 - t0:.1f} s, training {t2 - t1:.1f} s; wrote {a.out}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("model")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=55)
    p.add_argument("--max-positions", type=int, default=1024)
    p = sub.add_parser("masks")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--tok", required=True)
    p.add_argument("--date-string")
    p.add_argument("--show", type=int, help="print this example with TRL's mask marked")
    p = sub.add_parser("train")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--date-string")
    p.add_argument("--tok", help="tokenize_hf.py's file of the same data: step 1's loss recomputed from it")
    p.add_argument("--limit", type=int, help="train on the first N conversations (e.g. the file's training split)")
    p.add_argument("--seed", type=int, default=55)
    a = ap.parse_args()
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    return {"model": cmd_model, "masks": cmd_masks, "train": cmd_train}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
