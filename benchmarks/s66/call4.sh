#!/usr/bin/env bash
# Session 66 call 4 (written without a GPU: no machine was lent; for a later session, after call 3; ~7 min): the
# fp8_quant_fma knob (the per-group activation quantizers' division as a multiply by the scale's reciprocal and two
# FMA corrections: the same FP8 values, tools/quant_division_check.py), alone and with fp8_fused_quant, against FP8
# with neither and bf16 in this call: `atlas bench latency` on the Qwen3-8B shape, decode at batch 256 (128 in / 256
# out) and the TTFT of a 2,048-token prompt; then the FP8 kernel cases on the GPU with it (fp8_linear_cases.py: the
# quantizers against quantize_rows, bit for bit).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
run() {  # NAME MODEL [TUNING]
  local common=(--model $2 --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85
                --max-model-len 4096 --peer none ${3:+--tuning "$3"})
  timeout 90 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 256 --input-len 128 --output-len 256 \
    --num-iters 3 --num-iters-warmup 1 --output-json $OUT/$1_b256.json > $OUT/$1_b256.log 2>&1
  echo "$1 b256: exit $?; $(grep -E 'atlas batch' $OUT/$1_b256.log | sed 's/[0-9-]* [0-9:,]* INFO atlas.bench.latency: //')"
  timeout 60 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 1 --input-len 2048 --output-len 2 \
    --num-iters 5 --num-iters-warmup 1 --output-json $OUT/$1_ttft.json > $OUT/$1_ttft.log 2>&1
  echo "$1 ttft: exit $?; $(grep -iE 'ttft|prefill' $OUT/$1_ttft.log | tail -n 2 | tr '\n' ' ')"
}
run bf16 /tmp/q8
run fp8 /tmp/q8-fp8
run fp8_fma /tmp/q8-fp8 fp8_quant_fma=1
run fp8_fused_fma /tmp/q8-fp8 fp8_fused_quant=1,fp8_quant_fma=1
timeout 90 python3 - > $OUT/fma_cases.log 2>&1 <<'PY'
import sys
sys.path.insert(0, "tests")
import torch
import fp8_linear_cases as c
from atlas.config import TuningConfig
from atlas.kernels import settings
settings.set_kernel_settings(TuningConfig(fp8_quant_fma=True))
problems = c.check_all("cuda", torch.bfloat16, large=True)
print("\n".join(problems), f"{len(problems)} failure(s) with fp8_quant_fma")
PY
echo "FP8 cases with the knob: exit $?; $(tail -n 1 $OUT/fma_cases.log)"
tar -czf /tmp/c.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/c.tgz $OUT/call4.tgz
