#!/usr/bin/env bash
# Prepared in session 50 for the next GPU session (session 50's device time ran out): the MXFP4 decode from float32
# bits (_e2m1: five integer operations and a multiply a code), MXFP4's own pairs tile (1,024 columns) and the
# grouped kernel's interleaved MXFP4 tile again. (1) The expert kernels' CUDA tests (MXFP4 at gpt-oss-20b's
# shapes, the gpt-oss model eager and in graphs against the dequantized one, FP8, bf16). (2) The one-token MXFP4
# expert kernels by BLOCK_K, each checked against the bf16 kernels over the dequantized weights. (3) gpt-oss-20b's batch-1 step and 128-token TTFT
# (session 50 call 5: 6.57 ms, 53 ms with two half-depth dots; call 3: 6.80 ms, 37 ms; session 44, bf16 experts:
# 4.42 ms). The kernel bench also times the down kernel that loads a token's choices in one tile (moe_down_rows)
# and prefill's grouped matmuls at 128 and 2,048 tokens (MXFP4 and bf16 Triton, bf16 grouped GEMM).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
# (every expert-kernel CUDA test: session 50 also folded the bf16 and FP8 paths into one _accumulate helper after
#  its last full run, and added the rows form of down + combine, which moe_cases.py checks on CUDA)
timeout 240 python3 -m pytest -q -m cuda tests/test_moe_mxfp4.py tests/test_gpt_oss.py tests/test_moe_fp8.py \
  tests/test_deepseek_cuda.py -n 3 -p no:cacheprovider -rfE > $OUT/tests.log 2>&1
echo "exit $?" >> $OUT/tests.log; tail -n 2 $OUT/tests.log
timeout 100 python3 tools/moe_decode_kernel_bench.py --shape gpt-oss-20b --formats bf16,mxfp4 --block-k 1024,2048 \
  --warps 4,8 --prefill-tokens 128,2048 --out $OUT/kernels_gpt_oss.json > $OUT/kernels_gpt_oss.log 2>&1
timeout 40 python3 tools/moe_decode_kernel_bench.py --shape qwen3-30b-a3b --formats bf16 --block-k 1024,2048 \
  --warps 4 --out $OUT/kernels_qwen3.json > $OUT/kernels_qwen3.log 2>&1
cut -c1-300 $OUT/kernels_*.log
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
timeout 80 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
  --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 --input-len 128 --output-len 64 \
  --num-iters 2 --num-iters-warmup 1 --output-json $OUT/oss.json > $OUT/oss.log 2>&1
echo "oss: exit $?"; grep -E 'atlas batch (1|64):' $OUT/oss.log
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
