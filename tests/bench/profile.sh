#!/usr/bin/env bash
# Instruction profile of shardtrain's steady-state training step under callgrind.
#
#   tests/bench/profile.sh BIN OUTDIR
#
# Runs ONE rank as an MPI singleton (no mpirun) on the `demo` model:
#   BIN --model demo --data $DATA --seq-len 64 --global-batch 12 --threads 1 --eval-every 0
#       --eval-batches 1 --log-every 10 --steps $STEPS --device cpu
# once per OpenBLAS kernel set in $CORETYPES, and prints, per kernel set, a markdown table of the
# top ten functions by self (exclusive) instruction count, as a share of all instructions (Ir)
# of the steady-state steps.
#
# Steady state only: callgrind dumps a profile part on entry to Fsdp<float>::zero_grads (the first
# call of every step) and on entry to evaluate<float> (the final validation), so part k+1 holds
# exactly step k. Steps 2..STEPS are summed; start-up, step 1 (first-touch allocations, OpenBLAS
# buffers) and the final evaluation are left out. The parts are summed by the parser below, not by
# callgrind_annotate: valgrind 3.19's callgrind_annotate counts the cost of calls that began in an
# earlier part ("calls=0" lines) as the caller's self cost, so main() etc. would show ~100% self.
#
# Requirements and caveats (valgrind 3.19):
#  * BIN must not contain AVX-512 instructions, which valgrind cannot decode (SIGILL at the first
#    one): build it with `make MARCH=x86-64-v3` (AVX2 + FMA), not the default -march=native.
#  * OpenBLAS (DYNAMIC_ARCH) picks its kernels from CPUID, and valgrind's synthetic CPUID differs
#    from the host's, so the kernel set is always pinned with OPENBLAS_CORETYPE. `native` in
#    CORETYPES means the set OpenBLAS picks on this machine outside valgrind (found with
#    openblas_get_corename via python3 ctypes); AVX-512 sets (SkylakeX, Cooperlake,
#    SapphireRapids) fall back to Haswell, and the table says so.
#  * Valgrind runs FMA instructions through a helper, so AVX2/FMA kernels (Haswell) run far slower
#    under callgrind than SSE ones (Prescott): ~5M instructions/s against ~200M. One demo step is
#    ~0.7e9 instructions with Haswell kernels, ~2.0e9 with Prescott; with STEPS=3 the Prescott run
#    takes ~35 s and the Haswell run ~10 minutes (STEPS=2 saves one step, ~3 minutes).
#  * Instruction counts do not depend on machine load, so the shares are comparable across runs;
#    they are not time shares (a cache-missing instruction costs more than a register add).
#
# Environment (all optional):
#   DATA=path        token file (default: build/data/fortunes.tok, else ./fortunes.tok)
#   STEPS=3          steps to run; steps 2..STEPS are profiled (STEPS >= 2)
#   CORETYPES="native SkylakeX"  OpenBLAS kernel sets to profile, one run each (OPENBLAS_CORETYPE
#                    names; SkylakeX runs as Haswell, see above)
#   STEP_FN, EVAL_FN callgrind patterns of the per-step first call and of the evaluation
#                    (default '*Fsdp<float>::zero_grads*' and '*evaluate<float>*')
#   TOP=10           rows per table
# OUTDIR receives, per kernel set: callgrind parts (cg.<set>.out*), valgrind's log, the plain
# (non-valgrind) run's log with its wall seconds, and the table (top.<set>.md); summary.md holds
# all tables.
set -euo pipefail

if [ $# -ne 2 ]; then
  sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
BIN=$(readlink -f "$1")
OUTDIR=$2
STEPS=${STEPS:-3}
CORETYPES=${CORETYPES:-native SkylakeX}
STEP_FN=${STEP_FN:-'*Fsdp<float>::zero_grads*'}
EVAL_FN=${EVAL_FN:-'*evaluate<float>*'}
TOP=${TOP:-10}
if [ -z "${DATA:-}" ]; then
  for d in build/data/fortunes.tok fortunes.tok; do [ -s "$d" ] && DATA=$d && break; done
fi
[ -x "$BIN" ] || { echo "profile: no executable '$1'" >&2; exit 2; }
[ -s "${DATA:-}" ] || { echo "profile: no token file (set DATA=...; make data builds build/data/fortunes.tok)" >&2; exit 2; }
[ "$STEPS" -ge 2 ] || { echo "profile: STEPS must be >= 2 (step 1 is not profiled)" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "profile: valgrind not found" >&2; exit 2; }
DATA=$(readlink -f "$DATA")
mkdir -p "$OUTDIR"
OUTDIR=$(readlink -f "$OUTDIR")

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
ARGS=(--model demo --data "$DATA" --seq-len 64 --global-batch 12 --threads 1 --eval-every 0
      --eval-batches 1 --log-every 10 --steps "$STEPS" --device cpu)

# The OpenBLAS that BIN loads, and the kernel set it picks for a given OPENBLAS_CORETYPE (or none).
BLAS=$(ldd "$BIN" | awk '/libopenblas/ {print $3; exit}')
[ -n "$BLAS" ] || { echo "profile: '$BIN' does not link OpenBLAS" >&2; exit 2; }
corename() {  # corename [CORETYPE]
  env ${1:+OPENBLAS_CORETYPE=$1} python3 -c 'import ctypes, sys
l = ctypes.CDLL(sys.argv[1]); l.openblas_get_corename.restype = ctypes.c_char_p
print(l.openblas_get_corename().decode())' "$BLAS"
}
NATIVE=$(corename)
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }'; }

summary="$OUTDIR/summary.md"
{
  echo "# callgrind profile: $(basename "$BIN"), steps 2..$STEPS of $STEPS"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'), host CPU: $(lscpu | sed -n 's/^Model name: *//p')"
  echo "- binary: $BIN"
  echo "- OpenBLAS: $(readlink -f "$BLAS"), kernel set picked natively: $NATIVE"
  echo "- command: OPENBLAS_CORETYPE=<set> valgrind --tool=callgrind --dump-before='$STEP_FN'" \
       "--dump-before='$EVAL_FN' $(basename "$BIN") ${ARGS[*]}"
  echo
} >"$summary"

for ct in $CORETYPES; do
  want=$ct note=""
  [ "$ct" = native ] && want=$NATIVE && note="as installed: OpenBLAS picks $NATIVE on this CPU outside valgrind"
  case "$want" in
    SkylakeX|Cooperlake|SapphireRapids)
      note="${note:+$note; }$want kernels use AVX-512, which valgrind 3.19 cannot run: Haswell instead"
      want=Haswell ;;
  esac
  got=$(corename "$want")
  [ "$got" = "$want" ] || { echo "profile: OPENBLAS_CORETYPE=$want gives '$got'" >&2; exit 1; }
  tag=$ct; [ "$ct" = native ] || tag=$want
  echo "profile: kernel set $ct -> OPENBLAS_CORETYPE=$want" >&2

  # Sanity value: wall seconds of the same command without valgrind.
  t0=$(date +%s.%N)
  OPENBLAS_CORETYPE=$want "$BIN" "${ARGS[@]}" >"$OUTDIR/plain.$tag.log" 2>&1
  plain_s=$(since "$t0")
  echo "wall_s $plain_s" >>"$OUTDIR/plain.$tag.log"

  rm -f "$OUTDIR/cg.$tag.out"*
  t0=$(date +%s.%N)
  if ! OPENBLAS_CORETYPE=$want valgrind --tool=callgrind --callgrind-out-file="$OUTDIR/cg.$tag.out" \
      --dump-before="$STEP_FN" --dump-before="$EVAL_FN" "$BIN" "${ARGS[@]}" >"$OUTDIR/valgrind.$tag.log" 2>&1; then
    tail -n 25 "$OUTDIR/valgrind.$tag.log" >&2
    grep -q 'Unrecognised instruction' "$OUTDIR/valgrind.$tag.log" &&
      echo "profile: valgrind cannot decode an instruction of the binary (AVX-512?): rebuild with make MARCH=x86-64-v3" >&2
    exit 1
  fi
  vg_s=$(since "$t0")

  python3 - "$OUTDIR" "$tag" "$STEPS" "$TOP" "$want" "$note" "$plain_s" "$vg_s" <<'EOF' | tee "$OUTDIR/top.$tag.md" >>"$summary"
import glob, os, re, sys
outdir, tag, steps, top, coretype, note, plain_s, vg_s = sys.argv[1:]
steps, top = int(steps), int(top)

def parse(path):
    """Part number, trigger, and self Ir per (object, function) of one callgrind output file."""
    names = {"ob": {}, "fl": {}, "fn": {}}
    def name(kind, s):  # name compression: "(id) name" defines, "(id)" refers
        m = re.match(r"\((\d+)\)\s*(.*)", s)
        if not m: return s
        if m.group(2): names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), "?")
    part, trigger, cost = 0, "", {}
    ob = fn = ""
    skip = False  # the cost line after calls= is the call's inclusive cost, not self cost
    with open(path, errors="replace") as f:
        for line in f:
            c = line[:1]
            if c.isdigit() or c in "+-*":
                if skip: skip = False; continue
                v = line.split()
                if len(v) > 1: cost[(ob, fn)] = cost.get((ob, fn), 0) + int(v[1])
            elif line.startswith("calls="): skip = True
            elif line.startswith("ob="): ob = name("ob", line[3:].strip())
            elif line.startswith("fn="): fn = name("fn", line[3:].strip())
            elif line.startswith(("cob=")): name("ob", line[4:].strip())
            elif line.startswith(("cfn=")): name("fn", line[4:].strip())
            elif line.startswith(("fl=", "fi=", "fe=")): name("fl", line[3:].strip())
            elif line.startswith(("cfi=", "cfl=")): name("fl", line[4:].strip())
            elif line.startswith("part:"): part = int(line.split()[1])
            elif line.startswith("desc: Trigger:"): trigger = line.split(":", 2)[2].strip()
    return part, trigger, cost

parts = sorted(parse(p) for p in glob.glob(os.path.join(outdir, f"cg.{tag}.out*")))
# part 1: start-up; part k+1 (k >= 1): step k, ending at the next step's zero_grads or at evaluate.
steady = [p for p in parts if p[0] >= 3 and p[1].startswith("--dump-before")]
if len(steady) != steps - 1:
    sys.exit(f"profile: expected {steps - 1} steady-state parts, found {[(p[0], p[1]) for p in parts]}")
per_step = [sum(p[2].values()) for p in steady]
total = {}
for p in steady:
    for k, v in p[2].items(): total[k] = total.get(k, 0) + v
all_ir = sum(total.values())

def strip_balanced(s, op, cl, keep_after=("operator",)):
    out, depth = [], 0
    for i, ch in enumerate(s):
        if ch == op:
            if depth == 0 and any("".join(out).endswith(k) for k in keep_after):
                out.append(ch); continue
            depth += 1; continue
        if ch == cl and depth > 0:
            depth -= 1; continue
        if depth == 0: out.append(ch)
    return "".join(out)

def short(fn):
    if re.fullmatch(r"0x[0-9a-f]+", fn): return f"{fn} (no symbol)"
    s = re.sub(r"\s*\[clone [^\]]*\]", "", fn)
    s = s.replace("(anonymous namespace)::", "").replace("shardtrain::", "")
    s = s.replace("{lambda(", "{lambda[").replace(")#", "]#")  # keep lambdas' marks
    s = strip_balanced(s, "<", ">")
    s = strip_balanced(s, "(", ")")
    s = re.sub(r"\s+const$", "", s)
    s = s.replace("{lambda[", "{lambda(").replace("]#", ")#")
    return re.sub(r"@@?GLIBC[\w.]*$", "", s).strip()

def obj(ob):
    b = os.path.basename(ob)
    if b.startswith("libopenblas"): return "libopenblas"
    return re.sub(r"(-[\d.]+)?\.so(\.[\d.]+)*$", "", b)

rows = sorted(total.items(), key=lambda kv: -kv[1])[:top]
title = f"OPENBLAS_CORETYPE={coretype}" + (f" ({note})" if note else "")
print(f"## {tag}: {title}\n")
print(f"Steps 2..{steps}: {all_ir:,} instructions ({', '.join(f'{n / 1e6:,.0f}M' for n in per_step)} per step); "
      f"callgrind run {float(vg_s):.0f} s, plain run (not profiled, whole job) {float(plain_s):.1f} s.\n")
print("| rank | function | share of instructions (%) | object |")
print("|---:|---|---:|---|")
for i, ((ob, fn), v) in enumerate(rows, 1):
    print(f"| {i} | `{short(fn)}` | {100.0 * v / all_ir:.2f} | {obj(ob)} |")
cover = 100.0 * sum(v for _, v in rows) / all_ir
print(f"\nTop {len(rows)} together: {cover:.1f}% of instructions.")
blas = sorted({fn for (ob, fn) in total if "openblas" in ob and total[(ob, fn)] > 0})
print(f"\nOpenBLAS functions executed: {', '.join(blas)}\n")
EOF
done
echo "profile: tables in $summary" >&2
