#!/usr/bin/env bash
# Only rank 0 resolves the model config. A bad config must make every rank exit non-zero with
# rank 0's message, well inside a timeout (no rank left waiting in a collective).
source "$(dirname "$0")/common.sh"
DATA=$(test_corpus)
cat >"$WORK/bad_heads.json" <<'J'
{"architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 100, "intermediate_size": 64,
 "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 3}
J
cat >"$WORK/bad_kv.json" <<'J'
{"vocab_size": 258, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 3}
J
cat >"$WORK/bad_act.json" <<'J'
{"vocab_size": 258, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
 "num_attention_heads": 4, "hidden_act": "gelu"}
J
cat >"$WORK/bad_arch.json" <<'J'
{"architectures": ["GPT2LMHeadModel"], "vocab_size": 258, "hidden_size": 64, "intermediate_size": 64,
 "num_hidden_layers": 2, "num_attention_heads": 4}
J
printf '{"vocab_size": 258, "hidden_size": ' >"$WORK/truncated.json"
cat >"$WORK/good.json" <<'J'
{"architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 32, "intermediate_size": 48,
 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "bos_token_id": 256, "eos_token_id": 257}
J
COMMON=(--data "$DATA" --seq-len 16 --global-batch 6 --steps 1 --threads 1)
expect_fail heads_divide "num_attention_heads (3) does not divide hidden_size (100)" 3 --model "$WORK/bad_heads.json" "${COMMON[@]}"
expect_fail kv_divide "num_key_value_heads (3) does not divide num_attention_heads (4)" 3 --model "$WORK/bad_kv.json" "${COMMON[@]}"
expect_fail activation "only \"silu\"" 3 --model "$WORK/bad_act.json" "${COMMON[@]}"
expect_fail architecture "GPT2LMHeadModel" 3 --model "$WORK/bad_arch.json" "${COMMON[@]}"
expect_fail truncated_json "not valid JSON" 3 --model "$WORK/truncated.json" "${COMMON[@]}"
expect_fail missing_file "cannot open model config file '$WORK/nope.json'" 3 --model "$WORK/nope.json" "${COMMON[@]}"
expect_fail unknown_preset "unknown model preset 'llama-7b'" 3 --model llama-7b "${COMMON[@]}"
# The message is rank 0's, shown as such on every rank (no "rank N:" prefix from another rank).
grep -q "error \[rank 2/3\]: Invalid model config" "$WORK/heads_divide.log" || fail "rank 2 did not print rank 0's message"
# A valid config.json is accepted by every rank (untied head, GQA 4:2).
timeout -k 5 60 $MPIRUN -np 3 "$BIN" --model "$WORK/good.json" "${COMMON[@]}" >"$WORK/good.log" 2>&1 || { cat "$WORK/good.log"; fail "valid config.json refused"; }
grep -q "model custom" "$WORK/good.log" || fail "valid config.json: no model line"
echo "ok: valid config.json accepted on 3 ranks"
