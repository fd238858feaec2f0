#!/usr/bin/env bash
# scripts/plot_metrics.py: two metrics files in the format training writes (train rows {step, loss,
# lr, grad_norm, tokens_per_s, elapsed_s}: src/train/trainer_report.cpp; eval rows {step, val_loss}:
# src/train/trainer.cpp) give a PNG of sane size; a missing, an empty and an unusable file each fail
# with exit 1 and the file named.
# Needs only the venv (make venv); $1 (the build dir) is unused.
source "$(dirname "$0")/common.sh"
[ -x "$PY" ] || fail "no venv at $ROOT/.venv (make venv)"
PLOT="$PY $ROOT/scripts/plot_metrics.py"
cd "$WORK"
"$PY" - <<'EOF'
import json, math
for name, lr0, n in (("run-a.jsonl", 2e-3, 200), ("run-b.jsonl", 1e-3, 150)):
    with open(name, "w") as f:
        for s in range(1, n + 1):
            if s == 1 or s % 10 == 0 or s == n:
                lr = lr0 * min(1, s / 20) * (0.55 + 0.45 * math.cos(math.pi * s / n))
                f.write(json.dumps({"step": s, "loss": 5.5 * math.exp(-s / 60) + 1.8, "lr": lr,
                                    "grad_norm": 2.0 / math.sqrt(s), "tokens_per_s": 9000 + 50 * (s % 7),
                                    "elapsed_s": 0.2 * s}) + "\n")
            if s % 50 == 0 or s == n:
                f.write(json.dumps({"step": s, "val_loss": 5.5 * math.exp(-s / 60) + 1.9}) + "\n")
        if name == "run-b.jsonl":
            f.write('{"step": 151, "loss": 2.0, "l')  # a killed run's half-written last line: skipped
EOF
$PLOT run-a.jsonl run-b.jsonl --out curves.png >plot.log 2>&1 || { cat plot.log; fail "plot of two files"; }
cat plot.log
grep -q "run-b.jsonl: 16 train rows, 3 eval rows; .*(1 unreadable line(s) skipped)" plot.log || fail "summary of run-b"
"$PY" - <<'EOF' || fail "curves.png is not a sane PNG"
import struct
raw = open("curves.png", "rb").read()
assert raw[:8] == b"\x89PNG\r\n\x1a\n", raw[:8]
assert raw[12:16] == b"IHDR"
w, h = struct.unpack(">II", raw[16:24])
assert 600 <= w <= 4000 and 400 <= h <= 4000, (w, h)
assert len(raw) > 20000, len(raw)  # four panels of lines, not a blank canvas
print(f"ok: curves.png: PNG {w}x{h}, {len(raw)} bytes")
EOF
# Default --out: loss.png in the current directory.
$PLOT run-a.jsonl >/dev/null 2>&1 && [ -s loss.png ] || fail "default --out loss.png"
echo "ok: default --out loss.png"

refuse() {
  local name=$1 want=$2 rc=0
  shift 2
  $PLOT "$@" --out bad.png >"$name.log" 2>&1 || rc=$?
  [ "$rc" -eq 1 ] || { cat "$name.log"; fail "$name: exit status $rc, expected 1"; }
  grep -qF -- "$want" "$name.log" || { cat "$name.log"; fail "$name: output lacks '$want'"; }
  [ ! -e bad.png ] || fail "$name: wrote bad.png"
  echo "ok: $name -> $(cat "$name.log" | head -1 | cut -c1-150)"
}
: >empty.jsonl
printf 'not json\n{"no": "step"}\n' >junk.jsonl
refuse missing "metrics file 'nope.jsonl': no such file" run-a.jsonl nope.jsonl
refuse empty "metrics file 'empty.jsonl': no usable records" empty.jsonl
refuse junk "metrics file 'junk.jsonl': no usable records" junk.jsonl
echo "PASS"
