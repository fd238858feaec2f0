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
mk() {  # name json-fragment: a valid config with one key replaced
  "$ROOT/.venv/bin/python" -c 'import json,sys; c={"vocab_size":258,"hidden_size":32,"intermediate_size":48,"num_hidden_layers":1,"num_attention_heads":4}; c.update(json.loads(sys.argv[2])); open(sys.argv[1],"w").write(json.dumps(c))' "$WORK/$1.json" "$2"
}
mk wrapped_int '{"intermediate_size": 4294967360}'
mk bool_int '{"num_hidden_layers": true}'
mk float_int '{"vocab_size": 258.7}'
mk huge '{"hidden_size": 65536, "intermediate_size": 65536, "num_attention_heads": 64}'
COMMON=(--data "$DATA" --seq-len 16 --global-batch 6 --steps 1 --threads 1)
expect_fail heads_divide "num_attention_heads (3) does not divide hidden_size (100)" 3 --model "$WORK/bad_heads.json" "${COMMON[@]}"
expect_fail kv_divide "num_key_value_heads (3) does not divide num_attention_heads (4)" 3 --model "$WORK/bad_kv.json" "${COMMON[@]}"
expect_fail activation "only \"silu\"" 3 --model "$WORK/bad_act.json" "${COMMON[@]}"
expect_fail architecture "architecture [\"GPT2LMHeadModel\"] is not supported" 3 --model "$WORK/bad_arch.json" "${COMMON[@]}"
expect_fail truncated_json "not valid JSON" 3 --model "$WORK/truncated.json" "${COMMON[@]}"
mkdir -p "$WORK/adir.json"
expect_fail missing_file "cannot open model config file '$WORK/nope.json'" 3 --model "$WORK/nope.json" "${COMMON[@]}"
expect_fail unknown_preset "unknown model preset 'llama-7b'" 3 --model llama-7b "${COMMON[@]}"
expect_fail int_out_of_range "key 'intermediate_size' = 4294967360 is out of range" 3 --model "$WORK/wrapped_int.json" "${COMMON[@]}"
expect_fail bool_as_int "key 'num_hidden_layers' must be an integer, got true" 3 --model "$WORK/bool_int.json" "${COMMON[@]}"
expect_fail float_as_int "key 'vocab_size' must be an integer, got 258.7" 3 --model "$WORK/float_int.json" "${COMMON[@]}"
expect_fail too_large "more than 2^31 elements" 3 --model "$WORK/huge.json" "${COMMON[@]}"
expect_fail config_is_dir "model config file '$WORK/adir.json' is not a regular file (a directory)" 3 --model "$WORK/adir.json" "${COMMON[@]}"
# Issue 56: a Mixtral config.json parses and validates; the parallelism its blocks do not have yet
# (TP, CP) is refused on every rank, saying so; an MoE config with too many experts per token is
# refused naming the key.
mk mixtral '{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}'
mk topk '{"architectures": ["MixtralForCausalLM"], "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 5}'
expect_fail moe_tp "option '--tp' (3) with a mixture-of-experts model (MixtralForCausalLM) is not built yet" \
  3 --model "$WORK/mixtral.json" "${COMMON[@]}" --tp 3
expect_fail moe_topk "key 'num_experts_per_tok' = 5 must be between 1 and the number of experts (4)" 3 --model "$WORK/topk.json" "${COMMON[@]}"
# The message is rank 0's, shown as such on every rank (no "rank N:" prefix from another rank).
grep -q "error \[rank 2/3\]: Invalid model config" "$WORK/heads_divide.log" || fail "rank 2 did not print rank 0's message"
# A valid config.json is accepted by every rank (untied head, GQA 4:2).
timeout -k 5 60 $MPIRUN -np 3 "$BIN" --model "$WORK/good.json" "${COMMON[@]}" >"$WORK/good.log" 2>&1 || { cat "$WORK/good.log"; fail "valid config.json refused"; }
grep -q "model custom" "$WORK/good.log" || fail "valid config.json: no model line"
echo "ok: valid config.json accepted on 3 ranks"
