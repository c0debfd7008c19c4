#!/usr/bin/env bash
# Session 66 call 6 (written without a GPU: no machine was lent; for a later session; ~6 min): issue 34's offline
# row, never measured in FP8: "offline 1,000 x 512/256 >= 1.3x bf16". `atlas bench throughput` (the command of
# BENCHMARKS 2.1's run 13) on the Qwen3-8B shape, --load-format dummy: bf16, block-FP8, and block-FP8 with the
# fp8_fused_quant and fp8_quant_fma knobs (s66/call3-4), one after another in this call.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
tput() {  # NAME MODEL [TUNING]
  timeout 150 python3 -m atlas.cli bench throughput --model $2 --load-format dummy --skip-tokenizer-init \
    --max-model-len 4096 --gpu-memory-utilization 0.9 --num-prompts 1000 --input-len 512 --output-len 256 \
    ${3:+--tuning "$3"} --output-json $OUT/$1.json > $OUT/$1.log 2>&1
  echo "$1 (${3:-defaults}): exit $?; $(grep -iE 'output tok/s|tokens/s|throughput' $OUT/$1.log | tail -n 2 | tr '\n' ' ')"
}
tput bf16 /tmp/q8
tput fp8 /tmp/q8-fp8
tput fp8_fused_fma /tmp/q8-fp8 fp8_fused_quant=1,fp8_quant_fma=1
tar -czf /tmp/c.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/c.tgz $OUT/call6.tgz
