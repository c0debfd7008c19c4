#!/usr/bin/env bash
# Speed of Atlas on one GPU, from the repo root, in under ~9 minutes (a hard deadline keeps every step
# inside BUDGET_S): a random-weight Qwen3-8B-shaped checkpoint in /tmp, then
#   1. atlas bench latency at batch 1 and 256 (128 in / 256 out) against the plain-PyTorch peer, with
#      torch.profiler summaries of the decode steps,
#   2. atlas bench throughput, 1000 requests of 512 in / 256 out,
#   3. TTFT of one 2048-token prompt (atlas bench latency, output 2).
# Results: $OUT/speed_results.tar.gz (every JSON, text table, profile and log) and $OUT/summary.txt.
#
# CPU dry run of every step with the tiny shape:  DRY_RUN=1 OUT=/tmp/speed-out bash tools/gpu_speed.sh
# Knobs (environment): SHAPE, BUDGET_S, BATCHES, IN_LEN, OUT_LEN, ITERS, NUM_PROMPTS, TP_IN, TP_OUT,
# TTFT_LEN, PEER_COMPILE=1 (adds the torch.compile peer), DFLASH=1 (also writes the DFlash drafter and times and
# profiles its spec-cost steps),
# REBUILD=1 (rewrite a checkpoint left by an earlier run on the same machine), SKIP="latency throughput ttft"
# (steps left out), BASELINE_FLAGS="--tuning gemv=0 --no-split-kv" (the latency step again with those engine flags,
# without the peer, to compare kernel choices in one run), STRUCTURED=1 (the JSON-schema constraint's cost
# on the shipped model, concurrency 1 and 32, with the mask kernel and with the PyTorch path, --tuning mask_kernel=0),
# TESTS=1 (the CUDA tests first, a step per file; TESTS="cuda:240 dflash:150" names the files and their limits),
# SPEC=1 (n-gram and DFlash on the shipped model, then DFlash with the drafts read back at once, --tuning
# device_drafts=0). The 8B checkpoint is
# written only when a step needs it.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source tools/device_site.sh
START=$(date +%s)
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/atlas-speed}
RES=$WORK/results
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE=${SHAPE:-tiny} BATCHES=${BATCHES:-1,4} IN_LEN=${IN_LEN:-16} OUT_LEN=${OUT_LEN:-8} ITERS=${ITERS:-1}
  NUM_PROMPTS=${NUM_PROMPTS:-12} TP_IN=${TP_IN:-16} TP_OUT=${TP_OUT:-8} TTFT_LEN=${TTFT_LEN:-64}
  DRAFT_LENGTHS=${DRAFT_LENGTHS:-3}  # (the tiny shape's drafter has blocks of 4)
  ENGINE_FLAGS=(--kv-cache-memory 64MiB --max-model-len 256)
else
  ENGINE_FLAGS=(--gpu-memory-utilization 0.85 --max-model-len 4096)
fi
SHAPE=${SHAPE:-qwen3-8b}
BUDGET_S=${BUDGET_S:-540}
BATCHES=${BATCHES:-1,256}
IN_LEN=${IN_LEN:-128}
OUT_LEN=${OUT_LEN:-256}
ITERS=${ITERS:-3}
NUM_PROMPTS=${NUM_PROMPTS:-1000}
TP_IN=${TP_IN:-512}
TP_OUT=${TP_OUT:-256}
TTFT_LEN=${TTFT_LEN:-2048}
DRAFT_LENGTHS=${DRAFT_LENGTHS:-7,15}
CKPT=$WORK/$SHAPE
rm -rf "$RES"  # results of an earlier run on the same machine
mkdir -p "$OUT" "$RES"
LOG=$RES/progress.log

source tools/steps.sh  # log, left, step
skipped() { [[ " ${SKIP:-} " == *" $1 "* ]]; }

log "speed run: shape $SHAPE, budget ${BUDGET_S}s, results in $OUT"
{ command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  sources_hash; } > "$RES/machine.txt" 2>&1
cat "$RES/machine.txt"

needs_checkpoint() {
  ! skipped latency || ! skipped throughput || ! skipped ttft || [ -n "${BASELINE_FLAGS:-}${WIDE:-}" ] \
    || [ "${DFLASH:-0}" = 1 ]
}
if ! needs_checkpoint; then
  log "checkpoint: not needed by the steps asked for"
elif [ -f "$CKPT/config.json" ] && [ "${REBUILD:-0}" != 1 ] && ls "$CKPT"/*.safetensors > /dev/null 2>&1; then
  log "checkpoint: reusing $CKPT"
else
  step checkpoint 150 python3 tools/make_random_checkpoint.py --shape "$SHAPE" --out "$CKPT" \
    $([ "${DFLASH:-0}" = 1 ] && echo --dflash-drafter)
fi

if [ "${TESTS:-0}" != 0 ]; then  # the CUDA correctness tests first: figures of a wrong engine are worthless
  # (one step a file, each with its own limit, so that one slow file cannot starve the others; about 3
  #  minutes for test_cuda.py on an H200)
  TEST_FILES=$([ "$TESTS" = 1 ] && echo "cuda:240 deepseek_cuda:150 fused_ops:90 dflash:90" || echo "$TESTS")
  for t in $TEST_FILES; do
    step "tests_${t%%:*}" "${t##*:}" python3 -m pytest -q -m cuda "tests/test_${t%%:*}.py" -p no:cacheprovider -rfE \
      --durations=5
  done
fi

COMMON=(--model "$CKPT" --skip-tokenizer-init "${ENGINE_FLAGS[@]}")
skipped latency || step latency 300 python3 -m atlas.cli bench latency "${COMMON[@]}" --batch-size "$BATCHES" --input-len "$IN_LEN" \
  --output-len "$OUT_LEN" --num-iters "$ITERS" --num-iters-warmup 1 --profile "$RES/profile" --profile-steps 10 \
  $([ "${PEER_COMPILE:-0}" = 1 ] && echo --peer-compile) --output-json "$RES/latency.json"
if [ -n "${BASELINE_FLAGS:-}" ]; then
  # shellcheck disable=SC2086  # (BASELINE_FLAGS is a list of flags)
  step latency_baseline 200 python3 -m atlas.cli bench latency "${COMMON[@]}" $BASELINE_FLAGS --batch-size "$BATCHES" \
    --input-len "$IN_LEN" --output-len "$OUT_LEN" --num-iters "$ITERS" --num-iters-warmup 1 --peer none \
    --profile "$RES/profile_baseline" --profile-steps 10 --output-json "$RES/latency_baseline.json"
fi
skipped throughput || step throughput 200 python3 -m atlas.cli bench throughput "${COMMON[@]}" --num-prompts "$NUM_PROMPTS" \
  --input-len "$TP_IN" --output-len "$TP_OUT" --output-json "$RES/throughput.json"
if [ -n "${WIDE:-}" ]; then  # throughput with more sequences and a larger token budget, e.g. WIDE="512 16384"
  read -r WIDE_SEQS WIDE_TOKENS <<< "$WIDE"
  step throughput_wide 120 python3 -m atlas.cli bench throughput "${COMMON[@]}" --num-prompts "$NUM_PROMPTS" \
    --input-len "$TP_IN" --output-len "$TP_OUT" --max-num-seqs "$WIDE_SEQS" --max-num-batched-tokens "$WIDE_TOKENS" \
    --output-json "$RES/throughput_wide.json"
fi
skipped ttft || step ttft 120 python3 -m atlas.cli bench latency "${COMMON[@]}" --batch-size 1 --input-len "$TTFT_LEN" \
  --output-len 2 --num-iters 5 --num-iters-warmup 1 --output-json "$RES/ttft_$TTFT_LEN.json"

if [ "${DFLASH:-0}" = 1 ]; then  # one verify step of K drafts and one DFlash step against a plain step
  step spec_cost 120 python3 -m atlas.cli bench spec-cost "${COMMON[@]}" --draft-model "$CKPT/dflash-drafter" \
    --draft-lengths "$DRAFT_LENGTHS" --batch-size 1 --input-len 128 --output-len 64 --output-json "$RES/spec_cost.json" \
    --profile "$RES/profile_spec_cost" --profile-steps 10
  # (again with the drafts read back at once: two host waits a speculative step instead of one)
  step spec_cost_host_drafts 120 python3 -m atlas.cli bench spec-cost "${COMMON[@]}" --tuning device_drafts=0 \
    --draft-model "$CKPT/dflash-drafter" --draft-lengths "$DRAFT_LENGTHS" --batch-size 1 --input-len 128 --output-len 64 \
    --output-json "$RES/spec_cost_host_drafts.json"
fi
if [ "${SPEC:-0}" = 1 ]; then  # the shipped model and drafter: n-gram and DFlash against plain decoding
  STDLIB=()
  if [ -f .stdlib/stdlib-3.11.7.tar.xz ]; then
    mkdir -p /tmp/stdlib && tar -xJf .stdlib/stdlib-3.11.7.tar.xz -C /tmp/stdlib && STDLIB=(--stdlib-dir /tmp/stdlib)
  fi
  step spec 120 python3 -m atlas.cli bench spec --methods ngram,dflash --concurrency 1,16 \
    --gpu-memory-utilization 0.2 "${STDLIB[@]}" --output-json "$RES/spec_default.json"
  step spec_host_drafts 120 python3 -m atlas.cli bench spec --methods dflash --tuning device_drafts=0 \
    --concurrency 1,16 --gpu-memory-utilization 0.2 "${STDLIB[@]}" --output-json "$RES/spec_host_drafts.json"
fi

if [ "${STRUCTURED:-0}" = 1 ]; then  # needs xgrammar (carried as wheels on a machine without it)
  step structured 150 python3 -m atlas.cli bench structured --concurrency 1,32 --output-len 64 --repeats 3 \
    --gpu-memory-utilization 0.2 --output-json "$RES/structured.json"
  step structured_mask_torch 150 python3 -m atlas.cli bench structured --tuning mask_kernel=0 --concurrency 1,32 \
    --output-len 64 --repeats 3 --gpu-memory-utilization 0.2 --output-json "$RES/structured_mask_torch.json"
fi

# The summary ends with the tables, so that the tail of this script's output shows them.
{
  echo "Atlas speed run, shape $SHAPE, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - START )) s"
  cat "$RES/machine.txt"
  echo; cat "$LOG"
  for f in "$RES"/profile/*summary.txt "$RES"/profile_baseline/*summary.txt "$RES"/profile_spec_cost/*summary.txt; do [ -f "$f" ] && { echo; cat "$f"; }; done
  for f in latency latency_baseline throughput throughput_wide "ttft_$TTFT_LEN" spec_cost spec_cost_host_drafts spec_default \
      spec_host_drafts structured structured_mask_torch; do
    if [ -f "$RES/$f.txt" ]; then echo; cat "$RES/$f.txt"
    elif [ -f "$RES/$f.log" ]; then echo; echo "$f: no result (see $f.log in the tarball)"; fi
  done
} > "$RES/summary.txt" 2>&1
cp "$RES/summary.txt" "$OUT/summary.txt"
tar -czf "$OUT/speed_results.tar.gz" -C "$WORK" results
echo; echo "================ summary"; cat "$RES/summary.txt"
log "done: $(ls -la "$OUT" | tail -n +2 | awk '{print $5, $9}' | tr '\n' ' ')"
