#!/usr/bin/env bash
# Device call 4 (session 44): the fused MoE decode kernels (d9a7580: the router's choice in one kernel; gate|up with
# its activation and down with the weighted sum at up to 4 tokens): their CUDA tests, gpt-oss's CUDA file, then
# batch-1 decode of the Qwen3-30B-A3B shape with them on and off in the same run.
set -u
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ source tools/steps.sh; sources_hash; } > $OUT/summary.txt 2>&1
timeout 150 python3 -m pytest -q -m cuda tests/test_deepseek_cuda.py -k "moe or experts" -p no:cacheprovider -rfE \
  > $OUT/deepseek_moe.log 2>&1
echo "test_deepseek_cuda -k 'moe or experts': $(tail -1 $OUT/deepseek_moe.log)" >> $OUT/summary.txt
timeout 170 python3 -m pytest -q -m cuda tests/test_gpt_oss_cuda.py -p no:cacheprovider -rfE > $OUT/gpt_oss.log 2>&1
echo "test_gpt_oss_cuda: $(tail -1 $OUT/gpt_oss.log)" >> $OUT/summary.txt
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe --config-only > /dev/null
for run in fused:"" unfused:"moe_fused_routing=0,moe_fused_pairs=0"; do
  name=${run%%:*} knobs=${run#*:}
  timeout 130 python3 -m atlas.cli bench latency --model /tmp/moe --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 2 --num-iters-warmup 1 ${knobs:+--tuning $knobs} --profile $OUT/prof_$name --profile-steps 4 \
    --output-json $OUT/moe_b1_$name.json > $OUT/moe_b1_$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'ms_per_step|roofline|tok/s' $OUT/moe_b1_$name.log | tail -3)" >> $OUT/summary.txt
done
cat $OUT/summary.txt
