# Shared set-up for end-to-end tests: sourced with the build dir as $1.
set -euo pipefail
BUILD=${1:-build}
BIN=$(realpath "$BUILD/shardtrain")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
# When a rank exits non-zero, mpirun ends the others with SIGTERM and, odls_base_sigkill_timeout
# (1 s) later, SIGKILL; every refusal test pays that second twice over. The ranks of a refused job
# have printed their errors and left their last collective by then, so don't wait.
export OMPI_MCA_odls_base_sigkill_timeout=0
MPIRUN="mpirun --oversubscribe"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardtrain-e2e.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# A token file from Debian's fortunes (installed by make deps), made by shardtrain itself.
test_corpus() {
  local out=$WORK/corpus.tok
  if [ ! -f "$out" ]; then
    "$BIN" --mode prepare --input /usr/share/games/fortunes/fortunes --input /usr/share/games/fortunes/riddles \
      --out "$out" >/dev/null
  fi
  echo "$out"
}

# expect_fail NAME EXPECTED_SUBSTRING NP CMD...: the job must exit non-zero within 60 s, print
# EXPECTED_SUBSTRING, and every one of NP ranks must report the error.
expect_fail() {
  local name=$1 want=$2 np=$3
  shift 3
  local log=$WORK/$name.log rc=0
  timeout -k 5 60 $MPIRUN -np "$np" "$BIN" "$@" >"$log" 2>&1 || rc=$?
  [ "$rc" -ne 0 ] || fail "$name: exit status 0, expected failure"
  [ "$rc" -ne 124 ] || fail "$name: timed out (hang)"
  grep -qF -- "$want" "$log" || { cat "$log"; fail "$name: output lacks '$want'"; }
  for ((r = 0; r < np; r++)); do
    grep -q "error \[rank $r/$np\]" "$log" || { cat "$log"; fail "$name: rank $r did not report the error"; }
  done
  echo "ok: $name -> $(grep -m1 'error \[rank 0' "$log" | cut -c1-160)"
}

ROOT=$(realpath "$(dirname "${BASH_SOURCE[0]}")/../..")
PY=$ROOT/.venv/bin/python  # h5py, numpy (make venv)

# short_docs FILE N_TRAIN N_VAL: a byte-level token file (STTOKv1, format version 1: vocabulary 258,
# BOS 256, EOS 257) of short documents, each BOS, 1-38 printable bytes, EOS (3-40 tokens), random
# with seed 41; train and validation splits of N_TRAIN and N_VAL tokens (a document may be cut at a
# split's end). The CP and document-mask tests' packed data.
short_docs() {
  "$PY" "$ROOT/tests/e2e/short_docs.py" "$@"
}

# losses FILE: the training losses of a metrics file, one per line, full precision.
losses() { "$PY" -c 'import json,sys; [print(repr(json.loads(l)["loss"])) for l in open(sys.argv[1]) if "\"loss\"" in l]' "$1"; }

# start_link_flipper LINK A B: a background process that renames a fresh symbolic link over LINK,
# alternating its target between A and B every 0.2 ms (atomic: LINK always exists); its pid in FLIP.
# The swap races of link_swap_race.sh and hf_dir_swap_race.sh.
start_link_flipper() {
  "$PY" - "$1" "$2" "$3" <<'PY' &
import os, sys, time
p, a, b = sys.argv[1:4]
tmp, i = p + ".flip", 0
while True:
    os.symlink(b if i % 2 else a, tmp)
    os.replace(tmp, p)
    i += 1
    time.sleep(0.0002)
PY
  FLIP=$!
}
