#!/usr/bin/env bash
# --mode prepare streams: its peak memory (VmHWM, printed in the summary) is the same for a ~30 MB
# and a ~300 MB corpus (byte-level; differing by less than 30 MB), and the token counts are exact.
source "$(dirname "$0")/common.sh"
"$PY" - "$WORK" <<'PY'
import random, sys
r = random.Random(1)
w = "the quick brown fox jumps over the lazy dog and keeps running through the field".split()
para = " ".join(r.choice(w) for _ in range(200)) + "\n"
blk = (para * ((1 << 20) // len(para) + 1))[: 1 << 20]
for mb in (30, 300):
    with open(f"{sys.argv[1]}/c{mb}.txt", "w") as f:
        for _ in range(mb):
            f.write(blk)
PY
declare -A peak
for mb in 30 300; do
  "$BIN" --mode prepare --input "$WORK/c$mb.txt" --out "$WORK/c$mb.tok" >"$WORK/p$mb.log" 2>&1 || { cat "$WORK/p$mb.log"; fail "prepare $mb MB"; }
  cat "$WORK/p$mb.log"
  n=$((mb * 1048576 + 2))
  grep -q "$((n - n / 10)) train + $((n / 10)) validation tokens" "$WORK/p$mb.log" \
    || fail "$mb MB: token counts (bytes + BOS + EOS, split 90/10)"
  peak[$mb]=$(grep -o 'peak RSS [0-9.]* MB' "$WORK/p$mb.log" | grep -o '[0-9.]*')
  rm -f "$WORK/c$mb.txt" "$WORK/c$mb.tok"
done
awk -v a="${peak[30]}" -v b="${peak[300]}" 'BEGIN { d = b - a; if (d < 0) d = -d; exit !(d < 30) }' \
  || fail "peak RSS ${peak[30]} MB (30 MB corpus) vs ${peak[300]} MB (300 MB corpus): not constant"
echo "ok: peak RSS ${peak[30]} MB for 30 MB of text, ${peak[300]} MB for 300 MB: constant memory"
