#!/usr/bin/env bash
# Session 74 call 2 (carry [".whl"]; ~5 min): the hybrids' CUDA test, whose reference is now run on the CPU where the
# GPU machine's transformers predates its fix (call 1 had put it on the GPU: LLM's device auto) and whose tokens are
# compared up to a near-tie of the reference's logits (conftest.assert_greedy_agrees); every configuration of it, as
# the comparison changed for all; and MiniMax-M2's router test, whose CPU reference had the same slip. Then, on an H200, issue 34's batch-1 row (s71/next.sh's b1), one pass.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests hybrids 240 3 tests/test_ssm_hybrids.py -k test_on_cuda_the_graphs
# MiniMax-M2's router test, whose CPU reference also ran on the GPU in call 1 (the same device-auto slip)
cuda_tests minimax 90 1 "tests/test_moe_families.py::test_single_row_routers_run_the_gemv_on_cuda_and_give_transformers_tokens[minimax_m2]"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
  python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
  for run in "bf16 /tmp/q8" "fp8 /tmp/q8-fp8" "fp8_no_prefetch /tmp/q8-fp8 fp8_gemv_prefetch=0"; do
    set -- $run
    timeout 50 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
      --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none ${3:+--tuning "$3"} --batch-size 1 \
      --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 >> $OUT/b1.log 2>&1
    echo "$1: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1.log | tail -n 1)"
  done
fi
echo "done at ${SECONDS}s"
