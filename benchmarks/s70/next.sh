#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~9 min): (1) the LoRA CUDA test on the mended tree (the one-set
# engine of --tuning lora_base_graphs=0 now in it), the FP8 fused-quantization CUDA test, now also on a DeepSeek-V3
# MLA (what fp8_fused_quant's default waits for), and the core CUDA tests of session 70's dense families (Phi-3,
# Granite, OLMo 2 / 3, GLM-4, EXAONE 4, SmolLM3, Seed-OSS, ERNIE 4.5: graphs against eager, against transformers);
# (2) on an H200, issue 34's batch-1 row with fp8_gemv_prefetch on by default: bf16, FP8 block (default), FP8 block
# with the knob off, twice, alternated.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests lora 200 2 tests/test_lora_cuda.py tests/test_mixed_graphs.py
cuda_tests fused 150 2 tests/test_fp8_cuda.py -k fused_activation
cuda_tests families 240 4 tests/test_cuda.py -k "Phi3 or Granite or Olmo2 or Olmo3 or Glm4 or SmolLM3 or SeedOss or Ernie or Exaone"
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
b1() {  # NAME MODEL [TUNING]
  timeout 50 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none ${3:+--tuning "$3"} --batch-size 1 \
    --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 >> $OUT/b1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1.log | tail -n 1)"
}
for pass in 1 2; do
  b1 bf16 /tmp/q8
  b1 fp8 /tmp/q8-fp8
  b1 fp8_no_prefetch /tmp/q8-fp8 fp8_gemv_prefetch=0
done
