#!/usr/bin/env bash
# Session 55: the router's matmul joined to its choice at up to 8 tokens (kernels/moe_routing_triton.route_tokens,
# --tuning moe_router_kernel, on by default): (1) the MoE CUDA tests (test_deepseek_cuda.py checks the kernel against
# the PyTorch router; the MoE families' graphs tests run it inside CUDA graphs); (2) batch-1 and 64 decode of the
# Qwen3-30B-A3B and DeepSeek-V2-Lite shapes with the knob on and off (session 51: 3.18 and 3.92 ms at batch 1).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 200 python3 -m pytest -q -m cuda tests/test_deepseek_cuda.py tests/test_moe_fp8.py -n 4 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "MoE tests exit $?"; grep -E "passed|failed" $OUT/tests.log | tail -n 1; grep -E "^FAILED|^ERROR" $OUT/tests.log | head
for shape in qwen3-30b-a3b deepseek-v2-lite; do
  python3 tools/make_random_checkpoint.py --shape $shape --out /tmp/$shape --config-only > /dev/null
  for knob in 1 0; do
    timeout 75 python3 -m atlas.cli bench latency --model /tmp/$shape --load-format dummy --skip-tokenizer-init \
      --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 --input-len 128 \
      --output-len 64 --num-iters 3 --num-iters-warmup 1 --tuning moe_router_kernel=$knob \
      --output-json $OUT/${shape}_router$knob.json > $OUT/${shape}_router$knob.log 2>&1
    echo "$shape moe_router_kernel=$knob: exit $?; $(grep -E 'atlas batch (1|64):' $OUT/${shape}_router$knob.log | cut -c 30- | tr '\n' ' ')"
  done
done
