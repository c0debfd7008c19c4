#!/usr/bin/env bash
# Prepared in session 57. MoE routers now compute their logits in the model dtype where the reference does (Qwen3-MoE,
# Mixtral, Qwen3-Next / Qwen3.5-MoE; float32 before): (1) the MoE CUDA tests (test_deepseek_cuda.py: the routing
# kernel's cases, bf16 logits among them; test_moe_fp8.py); (2) batch-1 and 64 decode of the Qwen3-30B-A3B shape
# before and after in one call ("before": before.py, the routers built with float32 logits as until session 57).
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests moe 200 3 tests/test_deepseek_cuda.py tests/test_moe_fp8.py
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe --config-only > /dev/null
for i in 1 2; do
  for tree in after before; do
    run=(-m atlas.cli); [ $tree = before ] && run=(benchmarks/s58/call3/before.py)
    timeout 75 python3 "${run[@]}" bench latency --model /tmp/moe --load-format dummy \
      --skip-tokenizer-init --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 \
      --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 --output-json $OUT/moe_${tree}_$i.json \
      > /tmp/logs/moe_${tree}_$i.log 2>&1
    echo "$tree ($i): exit $?; $(grep -E 'atlas batch (1|64):' /tmp/logs/moe_${tree}_$i.log | cut -c 30- | tr '\n' ' ')"
  done
done
cp /tmp/logs/*.log $OUT/
cd $OUT && tar czf results.tgz --remove-files *.json *.txt *.log 2>/dev/null; ls $OUT
