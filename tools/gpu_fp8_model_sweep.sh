#!/usr/bin/env bash
# FP8 small-M kernel configs measured in the model (the microbenchmark of `atlas bench fp8 --part gemv` ranks them
# differently from a decode step): `atlas bench latency` at batch 1 on a Qwen3-8B-shaped block-FP8 checkpoint
# (--load-format dummy) once per config through the fp8_gemv tuning knob, and the bf16 model, in one run. From the
# repo root. Results: $OUT/fp8_sweep.txt (one line per run) and $OUT/fp8_sweep.tar.gz (each run's JSON and log).
#
# Knobs: CONFIGS (small-M configs for single rows), BATCH (1), TOKENS (output tokens, 64).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/sweep
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
run() {  # run NAME MODEL [FLAGS...]
  local name=$1 model=$2; shift 2
  timeout 120 python3 -m atlas.cli bench latency --model "$model" --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.5 --max-model-len 1024 --peer none --batch-size "${BATCH:-1}" --input-len 128 \
    --output-len "${TOKENS:-64}" --num-iters 3 --num-iters-warmup 1 --output-json "/tmp/sweep/$name.json" "$@" \
    > "/tmp/sweep/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc; $(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; \
print(f\"{r['ms_per_step']:.3f} ms/step, {r['decode_tok_per_s']:.0f} tok/s\")" "/tmp/sweep/$name.json" 2>/dev/null)" \
    | tee -a "$OUT/fp8_sweep.txt"
}
run bf16 /tmp/q8
for cfg in ${CONFIGS:-sum-n4k2048w4s3 xs-n16k128w4s4 xs-n32k128w4s4 xs-n8k128w8s4 dot-n64k128w4s3}; do
  run "fp8_$cfg" /tmp/q8-fp8 --tuning "fp8_gemv=${BATCH:-1}:$cfg"
done
tar czf "$OUT/fp8_sweep.tar.gz" -C /tmp sweep
