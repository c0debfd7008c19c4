#!/usr/bin/env bash
# Prepared in session 55: FP8 hybrids (attention, out_proj, MLP and expert weights in FP8; the linear-attention input
# projections in bf16). (1) the FP8 CUDA tests (the hybrids' FP8 layers go through the same FP8 GEMV / GEMM and
# expert kernels as the other families'); (2) `atlas bench latency` at batch 1 and 64 of the Qwen3.5-9B and
# Qwen3.6-35B-A3B shapes, FP8 block-scaled (--fp8 block, dummy weights) against bf16 in the same call.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 150 python3 -m pytest -q -m cuda tests/test_fp8_cuda.py tests/test_moe_fp8.py -n 3 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "FP8 tests exit $?"; grep -E "passed|failed" $OUT/tests.log | tail -n 1; grep -E "^FAILED|^ERROR" $OUT/tests.log | head
for shape in qwen3.5-9b qwen3.6-35b-a3b; do
  for fp8 in "" block; do
    out=/tmp/$shape${fp8:+-fp8}
    python3 tools/make_random_checkpoint.py --shape $shape --out $out --config-only ${fp8:+--fp8 $fp8} > /dev/null
    timeout 100 python3 -m atlas.cli bench latency --model $out --load-format dummy --skip-tokenizer-init \
      --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1,64 --input-len 128 \
      --output-len 64 --num-iters 3 --num-iters-warmup 1 --output-json $OUT/${shape}${fp8:+_fp8}.json \
      > /tmp/${shape}${fp8:+_fp8}.log 2>&1
    echo "$shape ${fp8:-bf16}: exit $?; $(grep -E 'atlas batch (1|64):' /tmp/${shape}${fp8:+_fp8}.log | cut -c 30- | tr '\n' ' ')"
  done
done
