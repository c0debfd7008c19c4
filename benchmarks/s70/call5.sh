#!/usr/bin/env bash
# Session 70 call 5 (carry [".whl"]; ~6 min on a cold machine): the graph set without the LoRA slots
# (--tuning lora_base_graphs, on by default). (1) the CUDA tests of the changed capture (graph_plan's two sets sharing
# pools, the mixed graphs, LoRA in graphs): tests/test_lora_cuda.py, test_mixed_graphs.py, test_cuda.py; (2) what
# --enable-lora costs a base-model step now (call 1's bench: Qwen3-8B shape, batch 1 and 64, 1 slot of rank 16, no
# adapter loaded), with lora_base_graphs=0 (the one set of before) beside it.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 230 python3 -m pytest -q -m cuda tests/test_lora_cuda.py tests/test_mixed_graphs.py tests/test_cuda.py \
  -n 4 -p no:cacheprovider -rA > $OUT/tests_lora_graphs.log 2>&1
echo "tests exit $?; $(grep -E "[0-9]+ (passed|failed|skipped|errors?)" $OUT/tests_lora_graphs.log | tail -n 1)"
grep -E "^FAILED|^ERROR" $OUT/tests_lora_graphs.log | head
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
bench() {  # NAME FLAGS...
  local name=$1; shift
  timeout 60 python3 -m atlas.cli bench latency --model /tmp/q8 --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 --input-len 128 --output-len 64 \
    --num-iters 3 --num-iters-warmup 1 "$@" > $OUT/$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch [0-9]+:|LoRA:|captured' $OUT/$name.log | tr '\n' ' ' | sed 's/[0-9-]* [0-9:,]* INFO atlas[.a-z_]*: //g')"
}
bench base
bench lora1 --enable-lora --max-loras 1 --max-lora-rank 16
bench lora1_one_set --enable-lora --max-loras 1 --max-lora-rank 16 --tuning lora_base_graphs=0
