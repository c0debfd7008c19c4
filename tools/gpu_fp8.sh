#!/usr/bin/env bash
# FP8 against bf16 on the GPU machine: `atlas bench latency` on a Qwen3-8B-shaped checkpoint (random weights drawn by
# the engine, --load-format dummy) in bf16 and with block-scaled FP8 linear layers (the Qwen -FP8 layout), one after
# the other in this run: decode at batch 1 and 256 (128 in / 256 out) and the TTFT of a 2,048-token prompt. From the
# repo root. Results: $OUT/fp8_<shape>_<variant>_{decode,ttft}.json.
#
# Knobs: BATCHES (1,256), VARIANTS ("bf16 block channel": channel is --quantization fp8 on the bf16 shape), SHAPE
# (qwen3-8b; any of tools/make_random_checkpoint.py's, e.g. qwen3-30b-a3b or deepseek-v2-lite, whose routed experts
# then stay FP8 too), TTFT=0 to skip the 2,048-token prompt, PROFILE=1 for torch.profiler summaries of a few decode
# steps at each batch size and of the 2,048-token prefill (`--profile`: kernels by kind, host gaps) in
# $OUT/profile_<shape>_<variant>/.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
shape=${SHAPE:-qwen3-8b}
python3 tools/make_random_checkpoint.py --shape "$shape" --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape "$shape" --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
for variant in ${VARIANTS:-bf16 block channel}; do
  case $variant in
    bf16) model=/tmp/q8; extra=() ;;
    block) model=/tmp/q8-fp8; extra=() ;;
    channel) model=/tmp/q8; extra=(--quantization fp8) ;;
  esac
  common=(--model "$model" --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85
          --max-model-len 4096 --peer none "${extra[@]}")
  prof=(); [ "${PROFILE:-0}" = 1 ] && prof=(--profile "$OUT/profile_${shape}_${variant}")
  python3 -m atlas.cli bench latency "${common[@]}" --batch-size "${BATCHES:-1,256}" --input-len 128 \
    --output-len 256 --num-iters 3 --num-iters-warmup 1 --output-json "$OUT/fp8_${shape}_${variant}_decode.json" \
    "${prof[@]}" \
    > "/tmp/logs/fp8_${shape}_${variant}_decode.log" 2>&1
  echo "fp8 $shape $variant decode: exit $?"; tail -6 "/tmp/logs/fp8_${shape}_${variant}_decode.log"
  [ "${TTFT:-1}" = 0 ] && continue
  python3 -m atlas.cli bench latency "${common[@]}" --batch-size 1 --input-len 2048 --output-len 2 --num-iters 5 \
    "${prof[@]}" \
    --num-iters-warmup 1 --output-json "$OUT/fp8_${shape}_${variant}_ttft.json" \
    > "/tmp/logs/fp8_${shape}_${variant}_ttft.log" 2>&1
  echo "fp8 $shape $variant ttft: exit $?"; tail -4 "/tmp/logs/fp8_${shape}_${variant}_ttft.log"
done
tar czf "$OUT/fp8_logs_${shape}.tar.gz" -C /tmp logs
