#!/usr/bin/env bash
# Prepared in session 56: first the FP8 CUDA tests after SMALL_M 64 -> 8 and the FP8 models' 8-token mixed-step graph
# (session 56 call 5 failed the graphs-against-eager test before that graph); then FP8 block-scaled against bf16 after rows 9-64 went to the W8A8 path (SMALL_M 8; session 56
# measured 16-64 through --tuning fp8_gemv before the table changed), for BENCHMARKS 2.6 and 14. The Qwen3-8B shape
# at batch 1, 2, 4, 8, 16, 64 and 256, bf16 and FP8 with the table, then rows 2-8 (whose W8A16 kernel reads all of x
# again for every 16 columns, as 16-64 rows did) on the W8A8 path and on wider tiles; the Qwen3.5-9B shape at 1 and
# 64 with the table.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests fp8 200 3 tests/test_fp8_cuda.py tests/test_moe_fp8.py tests/test_mixed_graphs.py
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8f --config-only --fp8 block > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9f --config-only --fp8 block > /dev/null
one="1:sum-n4k2048w4s3"
for run in "q8 bf16 -" "q8f table -" "q8f w8a8 $one;8:w8a8" "q8f wide $one;2:dot-n16k128w4s4;4:dot-n32k128w4s4;8:dot-n64k128w4s4" \
           "q9 bf16 -" "q9f table -"; do
  read -r model name table <<< "$run"
  sizes=1,2,4,8,16,64,256; [ ${model:0:2} = q9 ] && sizes=1,64
  tuning=(); [ "$table" != - ] && tuning=(--tuning "fp8_gemv=$table")
  timeout 120 python3 -m atlas.cli bench latency --model /tmp/$model --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size $sizes --input-len 128 \
    --output-len 64 --num-iters 3 --num-iters-warmup 1 "${tuning[@]}" --output-json $OUT/${model}_$name.json \
    > /tmp/logs/${model}_$name.log 2>&1
  echo "$model $name: exit $?; $(grep -E 'atlas batch [0-9]+:' /tmp/logs/${model}_$name.log | cut -c 30- | sed 's/atlas.bench.latency: //' | tr '\n' ' ')"
done
