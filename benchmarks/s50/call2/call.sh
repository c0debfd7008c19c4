#!/usr/bin/env bash
# Prepared in session 49 for the next GPU session. (1) The gpt-oss-20b published-shape CUDA test, which call 1
# refused at max_model_len 4096 over the fixed 256 MiB pool (now 1024; call 1 passed the 9B and MXFP4 ones). (2) FP8 MoE prefill:
# the grouped expert kernel's row chunks at 16 (the default) against moe_grouped_block_m=0 (by the rows per expert)
# on the Qwen3-30B-A3B FP8 shape, TTFT of 64 x 128-token prompts and of one 2,048-token prompt, and bf16 in the same
# call; decode at batch 1 and 64 (the knob does not change decode below 16 rows an expert).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 120 python3 -m pytest -q -m cuda tests/test_gpt_oss_cuda.py -k "20b_shape_runs" -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1; echo "exit $?" >> $OUT/tests.log
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe-fp8 --config-only --fp8 block > /dev/null
for run in "bf16 /tmp/moe 16" "fp8-m16 /tmp/moe-fp8 16" "fp8-auto /tmp/moe-fp8 0"; do
  set -- $run
  common=(--model $2 --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096
          --peer none --tuning moe_grouped_block_m=$3)
  timeout 150 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 1,64 --input-len 128 --output-len 64 \
    --num-iters 2 --num-iters-warmup 1 --output-json $OUT/moe_$1_decode.json > $OUT/moe_$1_decode.log 2>&1
  timeout 100 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 1 --input-len 2048 --output-len 2 \
    --num-iters 5 --num-iters-warmup 1 --output-json $OUT/moe_$1_ttft.json > $OUT/moe_$1_ttft.log 2>&1
done
tail -n 3 $OUT/tests.log
grep -hE "atlas batch (1|64):" $OUT/moe_*.log
