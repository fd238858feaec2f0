#!/usr/bin/env bash
# Chat and prompt/completion data into token format version 3 (issue 55, items 1 and 2), offline:
# tests/e2e/chat_make.py trains a small BPE tokenizer with the special tokens of two public
# chat-template styles (ChatML; Llama-3.1 headers with a "Today Date:" line) and saves it with each
# template as published (no {% generation %} markers) and with markers. scripts/tokenize_hf.py
# renders 50 conversations of very different lengths (and 12 prompt/completion records) with each;
# tests/e2e/chat_data_check.py parses every file with numpy alone and asserts ids, role classes,
# example starts and the whole-example validation split against transformers (module docstring).
# Then: 1 and 2 worker processes write the same bytes; a template that reads the date is refused
# without --date-string and gives the same file on every day with it; and bad inputs are refused
# naming the file and line, nothing written. Last (item 7), a chat model through import, a
# fine-tune on chat data and export: its chat_template.jinja and generation_config.json come back
# (the data's template after the fine-tune), and the fine-tune's export lists the end of turn in
# eos_token_id, so transformers' apply_chat_template + generate stop at it
# (tests/e2e/chat_export_check.py).
source "$(dirname "$0")/common.sh"
SCRIPT=$ROOT/scripts/tokenize_hf.py
"$PY" "$ROOT/tests/e2e/chat_make.py" "$WORK" >"$WORK/make.log" 2>&1 || { cat "$WORK/make.log"; fail "chat_make.py"; }
D="26 Jul 2024"
tok() {  # NAME DIR INPUT ARGS...: tokenize_hf.py into $WORK/NAME.tok
  local name=$1 dir=$2 in=$3
  shift 3
  timeout -k 5 300 "$PY" "$SCRIPT" --tokenizer "$WORK/$dir" --out "$WORK/$name.tok" --quiet "$in" "$@" \
    >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name: tokenize_hf.py failed"; }
}
check() {  # NAME DIR INPUT ARGS...
  local name=$1 dir=$2 in=$3
  shift 3
  "$PY" "$ROOT/tests/e2e/chat_data_check.py" "$WORK/$name.tok" "$WORK/$dir" "$in" "$@" || fail "$name: check"
}
for d in chatml llama3 chatml-gen llama3-gen; do
  tok "$d" "$d" "$WORK/chat.jsonl" --date-string "$D" --workers 2
  check "$d" "$d" "$WORK/chat.jsonl" --date-string "$D"
  grep -q "format version 3): 50 examples" "$WORK/$d.log" || { cat "$WORK/$d.log"; fail "$d: summary line"; }
done
# With and without markers, a template gives the same masks (ours put the markers where the prefix
# rule finds the answer); the files differ only in the recorded template.
cmp <("$PY" -c "import numpy as np,sys; sys.path.insert(0,'$ROOT/scripts'); import shardtrain_tokens as st; t=st.read_token_file('$WORK/chatml.tok'); sys.stdout.buffer.write(np.asarray(t['roles']).tobytes())") \
    <("$PY" -c "import numpy as np,sys; sys.path.insert(0,'$ROOT/scripts'); import shardtrain_tokens as st; t=st.read_token_file('$WORK/chatml-gen.tok'); sys.stdout.buffer.write(np.asarray(t['roles']).tobytes())") \
  || fail "chatml: the prefix rule's role classes differ from the generation markers'"
echo "ok: ChatML: role classes by prefix rendering equal those by {% generation %} markers, token for token"
for d in chatml llama3; do
  tok "pc-$d" "$d" "$WORK/pc.jsonl" --date-string "$D" --workers 1
  check "pc-$d" "$d" "$WORK/pc.jsonl" --date-string "$D"
done
tok chatml-w1 chatml "$WORK/chat.jsonl" --date-string "$D" --workers 1
cmp "$WORK/chatml.tok" "$WORK/chatml-w1.tok" || fail "1 and 2 workers wrote different files"
echo "ok: 1 and 2 worker processes write the same bytes"

# The date: refused without --date-string; with it, the file does not depend on today's date (a
# faked clock: faketime is not needed, the template's strftime_now is shadowed; a second day differs).
expect_refused() {  # NAME WANT TOKENIZE_ARGS...: exit 1, WANT in the error, no output file
  local name=$1 want=$2
  shift 2
  local rc=0
  timeout -k 5 120 "$PY" "$SCRIPT" --out "$WORK/$name.tok" --quiet "$@" >"$WORK/$name.log" 2>&1 || rc=$?
  [ "$rc" -eq 1 ] || { cat "$WORK/$name.log"; fail "$name: exit status $rc, expected 1"; }
  grep -qF -- "$want" "$WORK/$name.log" || { cat "$WORK/$name.log"; fail "$name: the error lacks '$want'"; }
  [ ! -e "$WORK/$name.tok" ] && ! compgen -G "$WORK/.$name.tok.*" >/dev/null || fail "$name: left a file behind"
  echo "ok: $name -> $(grep -m1 'error' "$WORK/$name.log" | cut -c1-200)"
}
expect_refused no_date "pass --date-string" --tokenizer "$WORK/llama3" "$WORK/chat.jsonl"
tok llama3-d2 llama3 "$WORK/chat.jsonl" --date-string "01 Jan 2031"
! cmp -s "$WORK/llama3.tok" "$WORK/llama3-d2.tok" || fail "another --date-string gave the same file"
check llama3-d2 llama3 "$WORK/chat.jsonl" --date-string "01 Jan 2031"

# Bad inputs. Each names the file and line (or the template / tokenizer files looked at).
J=$WORK/bad
mkdir -p "$J"
line() { printf '%s\n' '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'; }
{ line; printf '%s\n' '{"messages": [{"role": "wizard", "content": "x"}]}'; } >"$J/role.jsonl"
expect_refused unknown_role "role.jsonl:2: messages[0] has role 'wizard'" --tokenizer "$WORK/chatml" "$J/role.jsonl"
{ line; printf '%s\n' '{"messages": [{"role": "user"}]}'; } >"$J/nocontent.jsonl"
expect_refused no_content "nocontent.jsonl:2: messages[0] (user) has no string 'content'" --tokenizer "$WORK/chatml" "$J/nocontent.jsonl"
{ line; printf '%s\n' '{"messages": {"role": "user", "content": "x"}}'; } >"$J/notlist.jsonl"
expect_refused not_a_list "notlist.jsonl:2: 'messages' is not a non-empty list" --tokenizer "$WORK/chatml" "$J/notlist.jsonl"
{ line; printf '{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n'; } >"$J/utf8.jsonl"
expect_refused not_utf8 "utf8.jsonl:2: not a JSON line" --tokenizer "$WORK/chatml" "$J/utf8.jsonl"
{ line; line; } >"$J/long.jsonl"
SHARDTRAIN_TOKENIZE_MAX_LINE_BYTES=60 expect_refused long_line "long.jsonl:1: a line longer than 60 bytes" \
  --tokenizer "$WORK/chatml" "$J/long.jsonl"
{ line; printf '%s\n' '{"text": "plain text"}'; } >"$J/mixed.jsonl"
expect_refused mixed "mixed.jsonl:2: a text record among chat data" --tokenizer "$WORK/chatml" "$J/mixed.jsonl"
expect_refused no_template "has no chat template (looked at $WORK/plain/chat_template.jinja" --tokenizer "$WORK/plain" "$WORK/chat.jsonl"
expect_refused template_file "must be the model's directory" --tokenizer "$WORK/plain/tokenizer.json" "$WORK/chat.jsonl"
# A template that fails to render (an unknown filter), one that drops earlier assistant turns (as
# reasoning templates drop earlier thinking), and the same with generation markers.
mk_template() {  # NAME TEMPLATE: a copy of the ChatML directory with another template
  cp -r "$WORK/chatml" "$WORK/$1"
  printf '%s' "$2" >"$WORK/$1/chat_template.jinja"
}
mk_template t_broken "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}"
expect_refused broken_template "chat.jsonl:1: the chat template failed to render" --tokenizer "$WORK/t_broken" "$WORK/chat.jsonl"
DROP="{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}@G@{{ m.content }}<|im_end|>@E@{% else %}{{ m.content }}<|im_end|>{% endif %}
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"
mk_template t_drop "${DROP//@[GE]@/}"
expect_refused drops_turns "does not render the conversation as a growing prefix" --tokenizer "$WORK/t_drop" "$WORK/chat.jsonl"
G=${DROP//@G@/\{% generation %\}}
mk_template t_drop_gen "${G//@E@/\{% endgeneration %\}}"
expect_refused drops_turns_gen "{% generation %} span(s) rendered: the template drops or merges" --tokenizer "$WORK/t_drop_gen" "$WORK/chat.jsonl"
{ printf '%s\n' '{"messages": [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "x"}]}'; } >"$J/first.jsonl"
expect_refused assistant_first "first.jsonl:1: message 0 is an assistant message" --tokenizer "$WORK/chatml" "$J/first.jsonl"
printf '%s\n' '{"text": "not gzip"}' >"$J/bad.jsonl.gz"
expect_refused bad_gzip "bad.jsonl.gz: cannot read it" --tokenizer "$WORK/plain" "$J/bad.jsonl.gz"
# A template that calls strftime_now itself (no date_string guard): --date-string fixes the day.
mk_template t_clock "{{- 'Today ' + strftime_now('%d %b %Y') + '\n' }}$(cat "$WORK/chatml/chat_template.jinja")"
tok clock t_clock "$WORK/chat.jsonl" --date-string "$D" --workers 2
"$PY" - "$WORK/clock.tok" "$WORK/t_clock" <<'PY' || fail "clock: the fixed date is not in the rendered text"
import sys
from transformers import AutoTokenizer
import numpy as np, struct, json
raw = open(sys.argv[1], "rb").read()
n = sum(struct.unpack_from("<QQ", raw, 32))
tok = np.frombuffer(raw, dtype="<u2", count=n, offset=64)
text = AutoTokenizer.from_pretrained(sys.argv[2]).decode(tok[:40].tolist())
assert text.startswith("Today 26 Jul 2024\n"), text
print("ok: a template calling strftime_now renders --date-string's day:", repr(text[:24]))
PY
# Crafted version 3 metadata: every one a TokenFileError of the Python reader (the C++ reader's own
# cases are tests/unit/test_data_formats.cpp).
"$PY" - "$WORK/chatml.tok" "$ROOT/scripts" <<'PY' || fail "crafted version 3 files"
import json, struct, sys
sys.path.insert(0, sys.argv[2])
import shardtrain_tokens as st
raw = open(sys.argv[1], "rb").read()
b, J = struct.unpack_from("<II", raw, 24)
n = sum(struct.unpack_from("<QQ", raw, 32))
meta = json.loads(raw[64 + b * n: 64 + b * n + J])
def craft(name, f, header=None):
    m = json.loads(json.dumps(meta))
    f(m)
    blob = json.dumps(m).encode()
    h = bytearray(raw[:64])
    struct.pack_into("<I", h, 28, len(blob))
    if header:
        struct.pack_into("<QQ", h, 32, *header)
    p = sys.argv[1] + "." + name
    open(p, "wb").write(bytes(h) + raw[64:64 + b * n] + blob + raw[64 + b * n + J:])
    try:
        st.read_token_file(p)
    except st.TokenFileError as e:
        assert p in str(e), e
        return
    raise AssertionError(f"{name}: accepted")
ex = lambda k, v: (lambda m: m["examples"].__setitem__(k, v))
craft("count_str", ex("count", "abc"))
craft("count_null", ex("count", None))
craft("count_float", ex("count", 50.9))
craft("offset_str", lambda m: m["examples"]["starts"].__setitem__("offset", "x"))
craft("no_offset", lambda m: m["examples"]["starts"].pop("offset"))
craft("crc_str", lambda m: m["examples"]["roles"].__setitem__("crc32", "zz"))
craft("no_examples", lambda m: m.pop("examples"))
craft("files_list", lambda m: m["tokenizer"].__setitem__("files", []))
nt, nv = struct.unpack_from("<QQ", raw, 32)
craft("val_mid_example", lambda m: (m["examples"].__setitem__("train", m["examples"]["count"]),
                                    m["examples"].__setitem__("val", 0)), header=(nt - 7, nv + 7))
assert meta["examples"]["end_of_turn_ids"] == [2], meta["examples"]  # <|im_end|>
craft("eot_missing", lambda m: m["examples"].pop("end_of_turn_ids"))
craft("eot_extra", lambda m: m["examples"]["end_of_turn_ids"].append(599))
craft("eot_none", ex("end_of_turn_ids", []))
print("ok: 12 crafted version 3 metadata refused as TokenFileError, naming the file")
PY
# --mode prepare renders no chat template: it refuses chat records, naming the script that does.
rc=0
timeout -k 5 60 "$BIN" --mode prepare --input "$WORK/chat.jsonl" --out "$WORK/prep.tok" >"$WORK/prep.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] && [ ! -e "$WORK/prep.tok" ] || { cat "$WORK/prep.log"; fail "--mode prepare of chat data: exit $rc"; }
grep -q "chat.jsonl:1: a chat record: --mode prepare writes plain text only; .*scripts/tokenize_hf.py" "$WORK/prep.log" \
  || { cat "$WORK/prep.log"; fail "--mode prepare of chat data: the error does not name scripts/tokenize_hf.py"; }
echo "ok: --mode prepare refuses chat data -> $(grep -m1 'error' "$WORK/prep.log" | cut -c1-160)"

# Item 7: a chat model (the ChatML tokenizer and template, eos <|endoftext|>, end of turn <|im_end|>,
# a generation_config.json that does not name <|im_end|>, weights that answer X Y <|im_end|> and
# would go on) imported and exported; then fine-tuned 2 steps on chat data made with its tokenizer
# and another template (ChatML with {% generation %} markers), at a learning rate that leaves its
# answers as they were, and exported. chat_export_check.py checks both against transformers.
CX=$ROOT/tests/e2e/chat_export_check.py
one() {  # NAME ARGS...: one shardtrain run that must succeed
  local name=$1
  shift
  timeout -k 5 120 "$@" >"$WORK/$name.log" 2>&1 || { cat "$WORK/$name.log"; fail "$name"; }
}
"$PY" "$CX" make "$WORK/chatml" "$WORK/cm" || fail "chat_export_check.py make"
cp -r "$WORK/cm" "$WORK/cm-gen" && cp "$WORK/chatml-gen/chat_template.jinja" "$WORK/cm-gen/"
one cm_import "$BIN" --mode import --hf-dir "$WORK/cm" --out "$WORK/cm.h5"
one cm_export "$BIN" --mode export "$WORK/cm.h5" --out "$WORK/cm-hf"
grep -q "eos_token_id \[0, 6\]: the model's eos_token_id, those of the generation_config.json it carries" "$WORK/cm_export.log" \
  || { cat "$WORK/cm_export.log"; fail "cm_export: no note of the carried eos_token_id"; }
head -n 12 "$WORK/chat.jsonl" >"$WORK/cm-chat.jsonl"  # 12 conversations are enough here
tok cm-chat cm-gen "$WORK/cm-chat.jsonl" --workers 1
one cm_sft $MPIRUN -np 2 "$BIN" --model "$WORK/cm/config.json" --init-from "$WORK/cm.h5" --data "$WORK/cm-chat.tok" \
  --seq-len 256 --global-batch 2 --steps 2 --lr 1e-7 --min-lr 1e-7 --weight-decay 0 --eval-batches 1 --threads 1 \
  --checkpoint-dir "$WORK/cm-ck"
one cm_sft_export "$BIN" --mode export "$WORK/cm-ck/step_00000002.h5" --out "$WORK/cm-sft-hf"
grep -q "eos_token_id \[0, 2, 6\]: the model's eos_token_id, the end-of-turn ids of its chat data, those of the" "$WORK/cm_sft_export.log" \
  || { cat "$WORK/cm_sft_export.log"; fail "cm_sft_export: no note of the end of turn"; }
timeout -k 5 200 "$PY" "$CX" check "$WORK/cm" "$WORK/cm-gen" "$WORK/cm-hf" "$WORK/cm-sft-hf" "$BIN" "$WORK/cm.h5" \
  "$WORK/cm-ck/step_00000002.h5" || fail "chat_export_check.py check"
"$PY" "$CX" craft "$WORK/cm.h5" "$WORK/cm" eot_bad eot_vocab gen_bad || fail "chat_export_check.py craft"
# Refused: a carried file that transformers could not read or that names ids outside the model, at
# import (the file named) and in a checkpoint at export (the attribute or dataset named).
bad_model() {  # NAME FILE CONTENT: a copy of the chat model with FILE replaced
  cp -r "$WORK/cm" "$WORK/$1"
  printf '%b' "$3" >"$WORK/$1/$2"
}
bad_model m_gen_json generation_config.json '{"eos_token_id": [0, 2'
bad_model m_gen_vocab generation_config.json '{"eos_token_id": [0, 900]}'
bad_model m_tpl_utf8 chat_template.jinja '{{ messages }}\xff'
cp -r "$WORK/cm" "$WORK/m_tpl_big" && head -c 4194305 /dev/zero | tr '\0' x >"$WORK/m_tpl_big/chat_template.jinja"
expect_fail import_gen_json "'$WORK/m_gen_json/generation_config.json': not valid JSON" 1 --mode import --hf-dir "$WORK/m_gen_json" --out "$WORK/x.h5"
expect_fail import_gen_vocab "'$WORK/m_gen_vocab/generation_config.json': key 'eos_token_id' = [0,900]: id 900 is outside the vocabulary (vocab_size 600)" 1 \
  --mode import --hf-dir "$WORK/m_gen_vocab" --out "$WORK/x.h5"
expect_fail import_tpl_utf8 "'$WORK/m_tpl_utf8/chat_template.jinja': not UTF-8 text" 1 --mode import --hf-dir "$WORK/m_tpl_utf8" --out "$WORK/x.h5"
expect_fail import_tpl_big "chat_template.jinja' has 4194305 bytes, more than the 4194304 read from such a file" 1 \
  --mode import --hf-dir "$WORK/m_tpl_big" --out "$WORK/x.h5"
[ ! -e "$WORK/x.h5" ] || fail "a refused import wrote a checkpoint"
expect_fail export_eot_bad "attribute 'info' of group '/tokenizer' is malformed ('end_of_turn_ids' holds 700, not a token id below vocab_size 600)" 1 \
  --mode export "$WORK/cm-eot_bad.h5" --out "$WORK/x-hf"
expect_fail export_eot_vocab "checkpoint '$WORK/cm-eot_vocab.h5': end-of-turn id 700 (group /tokenizer) is outside the model's vocabulary (vocab_size 600)" 1 \
  --mode export "$WORK/cm-eot_vocab.h5" --out "$WORK/x-hf"
expect_fail export_gen_bad "dataset 'tokenizer/generation_config.json' of checkpoint '$WORK/cm-gen_bad.h5': key 'pad_token_id' must be a token id (an integer >= 0), got -1" 1 \
  --mode export "$WORK/cm-gen_bad.h5" --out "$WORK/x-hf"
echo "ok: test_chat_data"
