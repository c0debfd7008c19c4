#!/usr/bin/env bash
# Session 61 call 1: (1) the CUDA tests of the drafters that chain or decode (EAGLE-3, the draft model, MTP over MLA,
# DSA and hybrid targets); (2) `atlas bench spec-cost` on the Qwen3-8B shape (plain step, verify of K = 3 fixed
# drafts, and a drafter's whole step) with a random EAGLE-3 drafter in the published Qwen3-8B layout and a random
# Qwen3-0.6B-shaped draft model, K = 3, batch 1 and 16: this tree (drafter graphs; EAGLE-3 also without drafting
# right behind the verify step, --tuning draft_after_verify=0), then the tree before (benchmarks/s61/chained.patch
# reversed: eager drafters, drafting after the read-back), each run with its own plain step.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests drafters 170 3 -k "mtp or eagle3 or drafting or decode_steps" tests/test_eagle3.py \
  tests/test_draft_model_proposer.py tests/test_deepseek_cuda.py tests/test_dsa_mtp.py tests/test_hybrid_mtp.py \
  tests/test_mla_kv_cache_dtype.py
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-0.6b --out /tmp/q06 --config-only > /dev/null
mkdir -p /tmp/q8/eagle3
cat > /tmp/q8/eagle3/config.json <<'JSON'
{"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 12288,
 "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
 "rope_theta": 1000000.0, "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": false,
 "tie_word_embeddings": false, "vocab_size": 151936, "draft_vocab_size": 32000, "torch_dtype": "bfloat16"}
JSON
cost() {  # NAME METHOD DRAFTER [MORE FLAGS]
  local name=$1 method=$2 drafter=$3; shift 3
  timeout 85 python3 -m atlas.cli bench spec-cost --model /tmp/q8 --load-format dummy --skip-tokenizer-init \
    --speculative $method --draft-model $drafter --draft-lengths 3 --batch-size 1,16 --input-len 128 --output-len 64 \
    --num-iters 3 --gpu-memory-utilization 0.85 --max-model-len 4096 --output-json $OUT/$name.json "$@" \
    > /tmp/logs/$name.log 2>&1
  echo "$name: exit $?"; cat $OUT/$name.txt 2>/dev/null | cut -c1-200
}
cost eagle3_behind eagle3 /tmp/q8/eagle3
cost eagle3_graphs eagle3 /tmp/q8/eagle3 --tuning draft_after_verify=0
cost draft_graphs draft_model /tmp/q06
git apply -R benchmarks/s61/chained.patch && cost eagle3_eager eagle3 /tmp/q8/eagle3 && cost draft_eager draft_model /tmp/q06
cp /tmp/logs/*.log $OUT/ 2>/dev/null; tar czf /tmp/all.tgz -C $OUT . && mv /tmp/all.tgz $OUT/
