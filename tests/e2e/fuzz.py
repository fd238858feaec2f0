"""A small mutational fuzzer over every file shardtrain reads from strangers (issue 27).

  fuzz.py BIN SEEDS OUT [--cases N] [--seed S] [--jobs J] [--targets a,b] [--np2 K]

SEEDS is a directory that tests/e2e/test_fuzz.sh filled with valid files made by shardtrain itself
(and an NFKC SentencePiece model made by Python's sentencepiece). Each target mutates one kind of
file (bit flips, interesting integers, truncation, chunk deletion and duplication, and for JSON
values and safetensors headers structured edits: huge and negative numbers, paths that leave the
directory, wrong types) and runs the reader on it. Every case runs under a timeout and an address
space limit (ulimit -v, 4 GB), so that a hang or an allocation sized by the file shows as a failure.

Outcome of a case: exit 0 ("accepted"), or exit 1 with a line starting "shardtrain: error"
("refused"); anything else (a signal, another status, a refusal without the error line, a
timeout) is a failure, and its input, command and output are kept under OUT/failures/ for
reproduction. Cases are numbered; case i of target t uses its own random.Random(f"{seed}-{t}-{i}"),
so any single case can be rerun (--targets t --first i --cases 1); no state is shared between cases
(the values the mutators hand out are copies), so a case's input does not depend on those before it.
Standard library only.

An error of the harness itself (an exception in a mutator or in its file handling) is no failure of
shardtrain: it is printed as "fuzz harness error (not a shardtrain failure): ..." with the seed,
target, case and the command that reruns it, and the other cases still run. The summary gives, per
target, the cases run, accepted, refused, failed (shardtrain) and harness errors; the last line
reads "fuzz: N cases, A accepted, R refused, F failed, H harness errors in T s (...)". Exit status:
0 when every case was accepted or refused; bit 0 (1) set when shardtrain failed a case, bit 1 (2)
when the harness failed (2 also for an error outside the cases, and for bad arguments).

fuzz.py --self-test [SEEDS] checks the harness alone (no case runs; see self_test()).
"""
import argparse
import copy
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

INTERESTING_INTS = [0, 1, -1, 2**7, 2**8 - 1, 2**15, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1,
                    -(2**63), 2**64 - 1]
INTERESTING_VALUES = [0, -1, 1, 2**31, 2**32 + 64, 2**62, 2**63 - 1, 2**64 - 1, -(2**63), 1e308, -1.5, None, True,
                      "", "x", "/etc/passwd", "../../../../etc/passwd", "a/../../b", "model.safetensors", "\u0000",
                      "F32", "BF16", "I64", [], {}, [2**62, 4], [-1, 4], [0, 2**64 - 1], [[[[[]]]]], "a" * 5000]


def interesting_value(rng):
    """A fresh copy of one of INTERESTING_VALUES. Never the list's own object: a later edit of the
    case would change it for every case after (issue 53: a list appended into itself, json.dumps
    then failed with 'Circular reference detected', and cases depended on those run before)."""
    return copy.deepcopy(rng.choice(INTERESTING_VALUES))


# ---- mutations -------------------------------------------------------------------------------------
def mutate_bytes(rng, b, region=None):
    """1-4 random edits of `b`; within [lo, hi) when `region` is given (length kept)."""
    b = bytearray(b)
    lo, hi = region if region else (0, len(b))
    for _ in range(rng.randint(1, 4)):
        if hi <= lo:
            break
        op = rng.randrange(8 if region is None else 4)
        p = rng.randrange(lo, hi)
        if op == 0:  # bit flip
            b[p] ^= 1 << rng.randrange(8)
        elif op == 1:  # interesting byte
            b[p] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, 0x3A, 0x2F, 0x2E])
        elif op in (2, 3):  # interesting 4- or 8-byte little-endian integer
            n = 4 if op == 2 else 8
            v = rng.choice(INTERESTING_INTS) & ((1 << (8 * n)) - 1)
            p = min(p, max(lo, hi - n))
            b[p:p + n] = v.to_bytes(n, "little")[: max(0, hi - p)]
        elif op == 4:  # truncate
            del b[p:]
            hi = len(b)
        elif op == 5:  # delete a chunk
            del b[p:p + rng.randint(1, 64)]
            hi = len(b)
        elif op == 6:  # duplicate a chunk elsewhere
            q = rng.randrange(len(b))
            b[p:p] = b[q:q + rng.randint(1, 64)]
            hi = len(b)
        else:  # random bytes
            b[p:p + 8] = bytes(rng.randrange(256) for _ in range(8))
            hi = len(b)
    return bytes(b)


def mutate_json_value(rng, v, depth=0):
    """`v` (parsed JSON) with one random node replaced, deleted or duplicated."""
    if isinstance(v, dict) and v and (depth == 0 or rng.random() < 0.8):
        k = rng.choice(list(v))
        r = rng.random()
        if r < 0.1:
            del v[k]
        elif r < 0.2:
            v[k + rng.choice(["_", ".x", "/../x"])] = v[k]
        else:
            v[k] = mutate_json_value(rng, v[k], depth + 1)
        return v
    if isinstance(v, list) and v and rng.random() < 0.8:
        i = rng.randrange(len(v))
        r = rng.random()
        if r < 0.1:
            del v[i]
        elif r < 0.2:
            v.append(v[i])
        else:
            v[i] = mutate_json_value(rng, v[i], depth + 1)
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool) and rng.random() < 0.3:
        return v + rng.choice([-1, 1, 2**32])
    return interesting_value(rng)


def mutate_json(rng, b):
    try:
        v = json.loads(b)
    except ValueError:
        return mutate_bytes(rng, b)
    if rng.random() < 0.75:
        for _ in range(rng.randint(1, 2)):
            v = mutate_json_value(rng, v)
        return json.dumps(v).encode()
    return mutate_bytes(rng, b)


def mutate_safetensors(rng, b):
    """Structured (header JSON edited, length re-encoded, padded to 8) or raw."""
    if rng.random() < 0.6 and len(b) >= 8:
        n = struct.unpack_from("<Q", b)[0]
        try:
            h = json.loads(b[8:8 + n])
        except ValueError:
            return mutate_bytes(rng, b)
        h = mutate_json_value(rng, h)
        hs = json.dumps(h).encode()
        hs += b" " * (-len(hs) % 8)
        return struct.pack("<Q", len(hs)) + hs + b[8 + n:]
    return mutate_bytes(rng, b)


def proto_fields(b):
    """[(field, wire_type, start, end)] of a protobuf message; end of value bytes (wire type 2)."""
    out, p = [], 0

    def varint(p):
        v, s = 0, 0
        while p < len(b):
            c = b[p]
            p += 1
            v |= (c & 0x7F) << s
            s += 7
            if not c & 0x80:
                return v, p
        raise ValueError("truncated varint")

    while p < len(b):
        key, p = varint(p)
        wt = key & 7
        if wt == 0:
            _, p2 = varint(p)
        elif wt == 1:
            p2 = p + 8
        elif wt == 5:
            p2 = p + 4
        elif wt == 2:
            n, p = varint(p)
            p2 = p + n
        else:
            raise ValueError("wire type")
        out.append((key >> 3, wt, p, p2))
        p = p2
    return out


def charsmap_region(b):
    """[start, end) of normalizer_spec.precompiled_charsmap in a SentencePiece model, or None."""
    for f, wt, s, e in proto_fields(b):
        if f == 3 and wt == 2:
            for f2, wt2, s2, e2 in proto_fields(b[s:e]):
                if f2 == 2 and wt2 == 2 and e2 > s2:
                    return (s + s2, s + e2)
    return None


def mutate_sentencepiece(rng, b):
    """Raw, or (half the time, for a model with a charsmap) inside its precompiled_charsmap: the
    trie size, trie units and normalized strings, the blob's length kept so the proto stays valid."""
    region = charsmap_region(b)
    if region and rng.random() < 0.6:
        s, e = region
        b = bytearray(b)
        if rng.random() < 0.3:  # the trie size: past the blob, or a little short
            size = struct.unpack_from("<I", b, s)[0]
            struct.pack_into("<I", b, s, rng.choice([e - s, e - s - 1, e - s + 4, size + 4, size - 4, 2**31, 0, 4]) & 0xFFFFFFFF)
            return bytes(b)
        return mutate_bytes(rng, bytes(b), (s, e))
    return mutate_bytes(rng, b)


# ---- targets ---------------------------------------------------------------------------------------
def targets(bin_path, seeds, np2_every):
    """name -> (seeds [(kind, path under SEEDS)], mutate(rng, bytes), commands(rng, case_dir, file), is_dir):
    a case copies one seed (with is_dir, its whole directory, as case_dir/hf), mutates it, and runs
    the commands in order until one does not exit 0."""
    mpirun = ["mpirun", "--oversubscribe", "-np", "2"]

    def sp(rng, d, f):  # a SentencePiece model: loaded and used to encode (prepare)
        return [[bin_path, "--mode", "prepare", "--tokenizer", f, "--input", f"{seeds}/text.txt", "--out", f"{d}/x.tok"]]

    def hf(rng, d, f):  # an HF directory: import; a model that imports is then run (its tokenizer encodes)
        ck = f"{d}/x.h5"
        cmds = [[bin_path, "--mode", "import", "--hf-dir", f"{d}/hf", "--out", ck]]
        prompt = ["--prompt", "Hello, world. x"] if os.path.exists(f"{d}/hf/tokenizer.model") else ["--prompt-ids", "1,2"]
        cmds.append([bin_path, "--mode", "generate", ck, *prompt, "--max-new-tokens", "2"])
        return cmds

    def ckpt(rng, d, f):  # a checkpoint: inspect, export or resume (a handful at 2 ranks)
        which = rng.randrange(3)
        pre = mpirun if np2_every and rng.randrange(np2_every) == 0 else []
        if which == 0:
            return [pre + [bin_path, "--mode", "inspect", f]]
        if which == 1:
            return [pre + [bin_path, "--mode", "export", f, "--out", f"{d}/exp"]]
        return [pre + [bin_path, "--model", "tiny", "--data", f"{seeds}/c.tok", "--seq-len", "16", "--global-batch", "2",
                       "--steps", "3", "--eval-batches", "1", "--threads", "1", "--resume", f,
                       "--checkpoint-dir", f"{d}/ck"]]

    def tok(rng, d, f):  # a token file: a short training run reads it
        extra = ["--data-format", "nanogpt"] if f.endswith(".bin") and "nanogpt" in f else []
        val = ["--val-data", f] if f.endswith(".bin") else []
        return [[bin_path, "--model", "tiny", "--data", f, *val, *extra, "--seq-len", "8", "--global-batch", "1",
                 "--steps", "1", "--eval-batches", "1", "--threads", "1"]]

    def ini(rng, d, f):  # a job file: options parsed, the plan printed
        return [[bin_path, "--config", f, "--mode", "plan"]]

    return {
        "sentencepiece": ([("sp", "sp_identity.model"), ("sp", "sp_nfkc.model")], mutate_sentencepiece, sp, False),
        "safetensors": ([("hf", "hf_single/model.safetensors")], mutate_safetensors, hf, True),
        "index": ([("hf", "hf_sharded/model.safetensors.index.json")], mutate_json, hf, True),
        "config": ([("hf", "hf_single/config.json")], mutate_json, hf, True),
        "hf_tokenizer": ([("hf", "hf_sp/tokenizer.model"), ("hf", "hf_single/tokenizer.json")],
                         lambda rng, b: mutate_sentencepiece(rng, b) if b[:1] != b"{" else mutate_json(rng, b), hf, True),
        "checkpoint": ([("ck", "ckpt.h5")], mutate_bytes, ckpt, False),
        "token_file": ([("tok", "c.tok"), ("tok", "llmc.bin"), ("tok", "nanogpt.bin")], mutate_bytes, tok, False),
        "ini": ([("ini", "job.ini")], mutate_bytes, ini, False),
    }


def run_case(args, name, spec, i):
    seeds_list, mutate, commands, is_dir = spec
    rng = random.Random(f"{args.seed}-{name}-{i}")
    kind, rel = rng.choice(seeds_list)
    case = tempfile.mkdtemp(prefix=f"{name}-{i}-", dir=args.tmp)
    try:
        src = os.path.join(args.seeds, rel)
        if is_dir:  # copy the seed directory as 'hf', mutate one file in it
            shutil.copytree(os.path.dirname(src), os.path.join(case, "hf"))
            f = os.path.join(case, "hf", os.path.basename(src))
        else:
            f = os.path.join(case, os.path.basename(src))
            shutil.copy(src, f)
        data = open(f, "rb").read()
        open(f, "wb").write(mutate(rng, data))
        outcome, log = "accepted", ""
        # Open MPI's session directory in the case's own directory: in the shared /tmp/ompi.HOST.UID,
        # one job's clean-up removes the directory while another job starts in it ('A call to mkdir
        # was unable to create the desired directory ... orte_init failed', exit 1, seen in 1 of
        # 320 cases with other MPI jobs on the machine), a false failure of shardtrain.
        env = dict(args.env, OMPI_MCA_orte_tmpdir_base=case)
        for cmd in commands(rng, case, f):
            # ulimit -v, not prlimit --as: under prlimit the program crashed at start-up even with 1 TiB.
            full = ["bash", "-c", 'ulimit -v "$0" && exec "$@"', str(args.as_kib), *cmd]
            try:
                p = subprocess.run(full, cwd=case, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   timeout=args.timeout, env=env)
                out, rc = p.stdout.decode(errors="replace"), p.returncode
            except subprocess.TimeoutExpired as e:
                out, rc = (e.stdout or b"").decode(errors="replace"), "timeout"
            log += f"$ {' '.join(cmd)}\n{out}\n[exit {rc}]\n"
            if rc == 0:
                continue
            if rc == 1 and any(line.startswith("shardtrain: error") for line in out.splitlines()):
                outcome = "refused"
                break
            outcome = "failed"
            break
        if outcome == "failed":
            keep = os.path.join(args.out, "failures", f"{name}-{i}")
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(case, keep, ignore=shutil.ignore_patterns("*.h5.tmp", "exp", "ck", "ompi.*"))
            open(os.path.join(keep, "log.txt"), "w").write(log)
        return name, i, outcome, log
    finally:
        shutil.rmtree(case, ignore_errors=True)


def run_case_guarded(args, name, spec, i):
    """run_case, an exception of the harness itself (not of shardtrain) turned into outcome
    "harness" with its traceback, so that the cases after it still run."""
    try:
        return run_case(args, name, spec, i)
    except Exception:
        return name, i, "harness", traceback.format_exc()


# ---- self-test of the harness (issue 53) ----------------------------------------------------------
SAMPLE_JSON = [  # small documents of the shapes the JSON targets read (config, index, tokenizer.json)
    b'{"vocab_size": 512, "hidden_size": 16, "num_hidden_layers": 1, "rope_theta": 10000.0, "eos_token_id": [1, 2],'
    b' "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}, "tie_word_embeddings": false, "x": null}',
    b'{"metadata": {"total_size": 4096}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",'
    b' "lm_head.weight": "model-00002-of-00002.safetensors"}}',
    b'{"version": "1.0", "added_tokens": [{"id": 0, "content": "<s>", "special": true}], "model": {"type": "BPE",'
    b' "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"], [[], [[]]]]}, "pre_tokenizer": null}',
    b'[[[1, 2], [3]], [], {"a": [[], {}]}, "s", 1.5]',
]


def containers(v):
    """Every list and dict in `v` (parsed JSON), each once (a shared one is met once)."""
    seen, stack, out = set(), [v], []
    while stack:
        x = stack.pop()
        if isinstance(x, (list, dict)) and id(x) not in seen:
            seen.add(id(x))
            out.append(x)
            stack.extend(x.values() if isinstance(x, dict) else x)
    return out


def self_test(seeds=None, cases=400):
    """The harness's own check, run by test_fuzz.sh before any case: the JSON and safetensors
    mutators, applied `cases` times to each sample (and seed, when SEEDS is given) with fixed seeds,
    never raise, return bytes, hand out no object of INTERESTING_VALUES (each value in a mutated
    tree is a copy) and leave INTERESTING_VALUES unchanged; a case's bytes do not depend on the cases
    run before it (forward and reverse order agree). Raises AssertionError on the first violation."""
    snapshot = repr(INTERESTING_VALUES)
    shared = {id(x) for x in containers(INTERESTING_VALUES)}
    docs = [(f"sample{k}", b, mutate_json) for k, b in enumerate(SAMPLE_JSON)]
    for rel, mutate in (("hf_single/config.json", mutate_json), ("hf_single/tokenizer.json", mutate_json),
                        ("hf_sharded/model.safetensors.index.json", mutate_json),
                        ("hf_single/model.safetensors", mutate_safetensors)):
        if seeds:
            docs.append((rel, open(os.path.join(seeds, rel), "rb").read(), mutate))
    for name, b, mutate in docs:
        if mutate is mutate_json:  # the edits of the parsed value, as mutate_json makes them (twice)
            for i in range(cases):
                rng, v = random.Random(f"self-test-{name}-{i}-tree"), json.loads(b)
                for _ in range(2):
                    v = mutate_json_value(rng, v)
                    hit = [x for x in containers(v) if id(x) in shared]
                    assert not hit, f"{name} case {i}: mutate_json_value handed out INTERESTING_VALUES' own {hit[0]!r:.80}"
                json.dumps(v)  # the failure: 'Circular reference detected'
        outs = {}
        for i in list(range(cases)) + list(reversed(range(cases))):
            try:
                out = mutate(random.Random(f"self-test-{name}-{i}"), b)
            except Exception as e:
                raise AssertionError(f"{name} case {i}: {mutate.__name__} raised {type(e).__name__}: {e}") from e
            assert isinstance(out, bytes), f"{name} case {i}: {mutate.__name__} returned {type(out).__name__}"
            assert outs.setdefault(i, out) == out, f"{name} case {i}: its bytes depend on the cases run before it"
        assert repr(INTERESTING_VALUES) == snapshot, f"INTERESTING_VALUES changed by the mutations of {name}"
    # A mutator that raises makes a harness error of its case, not a failure, and no exception.
    with tempfile.TemporaryDirectory() as tmp:
        open(os.path.join(tmp, "seed.json"), "wb").write(SAMPLE_JSON[0])

        def broken(rng, b):
            raise ValueError("Circular reference detected")
        args = argparse.Namespace(seed="self-test", seeds=tmp, tmp=tmp, out=tmp)
        spec = ([("x", "seed.json")], broken, lambda rng, d, f: [["true"]], False)
        _, _, outcome, log = run_case_guarded(args, "x", spec, 0)
        assert outcome == "harness" and "Circular reference" in log, f"a mutator's exception gave {outcome!r}"
    print(f"fuzz self-test: ok ({len(docs)} documents x {cases} cases, forward and reverse)")


def rerun_command(args, name, i):
    return (f"{sys.executable} {os.path.abspath(__file__)} {args.bin} {args.seeds} {args.out} --seed {args.seed} "
            f"--targets {name} --first {i} --cases 1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin", nargs="?")
    ap.add_argument("seeds", nargs="?")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--self-test", nargs="?", const="", metavar="SEEDS",
                    help="check the harness itself (on samples, and the seeds of SEEDS when given), run no case")
    ap.add_argument("--cases", type=int, default=int(os.environ.get("FUZZ_CASES", "0")) or None,
                    help="cases in all, spread over the targets (default: 40 per target)")
    ap.add_argument("--first", type=int, default=0, help="number of the first case of each target")
    ap.add_argument("--seed", default=os.environ.get("FUZZ_SEED", "27"))
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("FUZZ_JOBS", "2")))
    ap.add_argument("--targets", default="")
    ap.add_argument("--np2", type=int, default=10, help="one checkpoint case in K runs at 2 ranks (0: none)")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--as-kib", type=int, default=4_000_000, help="address space limit of each command (ulimit -v, KiB)")
    args = ap.parse_args()
    if args.self_test is not None:
        self_test(args.self_test or None)
        return 0
    if not args.out:
        ap.error("BIN, SEEDS and OUT are required (or --self-test)")
    args.bin = os.path.abspath(args.bin)
    args.seeds = os.path.abspath(args.seeds)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    args.tmp = tempfile.mkdtemp(prefix="fuzz-", dir=os.environ.get("TMPDIR", "/tmp"))
    args.env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_vader_single_copy_mechanism="none",
                    OMPI_MCA_odls_base_sigkill_timeout="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    ts = targets(args.bin, args.seeds, args.np2)
    names = [t for t in ts if not args.targets or t in args.targets.split(",")]
    per = max(1, (args.cases + len(names) - 1) // len(names)) if args.cases else 40
    work = [(n, i) for i in range(args.first, args.first + per) for n in names]
    t0 = time.time()
    kinds = ("accepted", "refused", "failed", "harness")
    counts = {n: dict.fromkeys(kinds, 0) for n in names}
    failed, harness = [], []
    with ThreadPoolExecutor(args.jobs) as ex:
        for name, i, outcome, log in ex.map(lambda w: run_case_guarded(args, w[0], ts[w[0]], w[1]), work):
            counts[name][outcome] += 1
            done = sum(sum(c.values()) for c in counts.values())
            if done % 250 == 0:
                print(f"  ... {done}/{len(work)} cases, {sum(c['failed'] for c in counts.values())} failed, "
                      f"{time.time() - t0:.0f} s", flush=True)
            if outcome == "failed":
                failed.append(f"{name}-{i}")
                print(f"FAILED {name} case {i}: input and log in {args.out}/failures/{name}-{i}\n{log[-2000:]}", flush=True)
            elif outcome == "harness":
                harness.append(f"{name}-{i}")
                print(f"fuzz harness error (not a shardtrain failure): target {name} case {i} (seed {args.seed}): "
                      f"{log.strip().splitlines()[-1]}\n{log}rerun: {rerun_command(args, name, i)}", flush=True)
    shutil.rmtree(args.tmp, ignore_errors=True)
    for n in names:
        c = counts[n]
        print(f"  {n:14s} {sum(c.values()):5d} cases: {c['accepted']} accepted, {c['refused']} refused, "
              f"{c['failed']} failed, {c['harness']} harness errors")
    tot = {k: sum(c[k] for c in counts.values()) for k in kinds}
    ran = sum(tot.values())
    assert ran == len(work), f"{ran} of {len(work)} cases reported"
    if failed:
        print(f"shardtrain failed {len(failed)} cases: {' '.join(failed)}")
    if harness:
        print(f"fuzz harness error (not a shardtrain failure) in {len(harness)} cases: {' '.join(harness)}")
    print(f"fuzz: {len(work)} cases, {tot['accepted']} accepted, {tot['refused']} refused, {tot['failed']} failed, "
          f"{tot['harness']} harness errors in {time.time() - t0:.0f} s (seed {args.seed}, {args.jobs} jobs)")
    return (1 if failed else 0) | (2 if harness else 0)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # the harness's own bug: never reported as shardtrain's
        print(f"fuzz harness error (not a shardtrain failure):\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(2)
