#!/usr/bin/env bash
# Tensor and pipeline parallelism on two GPUs of one host (nvidia-h200-x2), from the repo root, each PART
# inside one command's 10 minutes (a deadline keeps every step inside BUDGET_S):
#   PART=check       Qwen3-8B-shaped random checkpoint; TP=2 greedy tokens equal TP=1 in float32 (and their
#                    agreement in bf16); batch-1 decode tok/s at TP=2 against TP=1 (tools/parallel_bench.py),
#                    with NCCL all-reduces and with the experimental symmetric-memory one (SYMM= skips it)
#   PART=throughput  atlas bench throughput, 1000 x 512 in / 256 out, TP=1 then TP=2
#   PART=pp          PP=2 on the 8B shape: the same check and decode against TP=1, and its throughput, each also with the
#                    stages run eagerly (--tuning pp_graphs=0; by default each stage replays CUDA graphs)
#   PART=serve32b    a Qwen3-32B-shaped checkpoint (64 layers, hidden 5120, 64/8 heads, intermediate 25600)
#                    served at TP=2: atlas bench serve (streaming load) against the offline engine, same run
#   PART=spec        the shipped model and its DFlash drafter at TP=1, TP=2 and PP=2: atlas bench spec (plain,
#                    n-gram, DFlash; the drafter runs on the driver), greedy equality included (SPEC_LAYOUTS="tp1 tp2 pp2")
#   PART=ep          a DeepSeek-V2-Lite-shaped checkpoint at TP=2: batch-1 and batch-64 decode with the routed
#                    experts tensor-sharded (the default) and expert-parallel (--enable-expert-parallel)
#   PART=all         all six in that order (needs about 35 minutes; give BUDGET_S)
# Several parts: PART="check pp" runs those.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1).
# Results: $OUT/summary.txt, $OUT/results.json (every JSON of the run), $OUT/parallel_logs.tar.gz (logs,
# texts); three files. A later PART on the same machine reuses the checkpoints and adds to the results.
#
# CPU dry run of every part with the tiny shape (the serve part with the built-in model), about 2 minutes:
#   DRY_RUN=1 PART=all OUT=/tmp/par-out bash tools/gpu_parallel.sh
# Knobs (environment): SHAPE, SHAPE_32B, BUDGET_S, NUM_PROMPTS, TP_IN, TP_OUT, IN_LEN, OUT_LEN, ITERS,
# SERVE_REQUESTS, SERVE_CONCURRENCY, SERVE_TOKENS, REBUILD=1 (rewrite checkpoints left by an earlier run),
# PP_THROUGHPUT=0 (part pp without its throughput run), SYMM= (part check without the symmetric-memory layout),
# PROFILE_STEPS (decode steps profiled on the driver in each decode part; 0: none).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source tools/device_site.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s)
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/atlas-parallel}
RES=$WORK/results
PART=${PART:-check}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE=${SHAPE:-tiny} SHAPE_32B=${SHAPE_32B:-tiny} SHAPE_MOE=${SHAPE_MOE:-deepseek-tiny} NUM_PROMPTS=${NUM_PROMPTS:-12} TP_IN=${TP_IN:-16} TP_OUT=${TP_OUT:-8}
  IN_LEN=${IN_LEN:-32} OUT_LEN=${OUT_LEN:-16} ITERS=${ITERS:-1} SERVE_REQUESTS=${SERVE_REQUESTS:-8}
  SERVE_CONCURRENCY=${SERVE_CONCURRENCY:-4} SERVE_TOKENS=${SERVE_TOKENS:-8} CHECK=(--check-tokens 16)
  ENGINE_FLAGS=(--kv-cache-memory 64MiB --max-model-len 256 --num-cpu-threads 1)
else
  CHECK=()
  ENGINE_FLAGS=(--gpu-memory-utilization 0.85 --max-model-len 4096)
fi
SHAPE=${SHAPE:-qwen3-8b}
SHAPE_32B=${SHAPE_32B:-qwen3-32b}
SHAPE_MOE=${SHAPE_MOE:-deepseek-v2-lite}
BUDGET_S=${BUDGET_S:-560}
NUM_PROMPTS=${NUM_PROMPTS:-1000}
TP_IN=${TP_IN:-512}
TP_OUT=${TP_OUT:-256}
IN_LEN=${IN_LEN:-128}
OUT_LEN=${OUT_LEN:-256}
ITERS=${ITERS:-3}
SERVE_REQUESTS=${SERVE_REQUESTS:-256}
SERVE_CONCURRENCY=${SERVE_CONCURRENCY:-32}
SERVE_TOKENS=${SERVE_TOKENS:-256}
PROFILE_STEPS=${PROFILE_STEPS:-10}  # decode steps profiled on the driver in each layout's decode part (0: none)
CKPT=$WORK/$SHAPE
CKPT_32B=$WORK/$SHAPE_32B
CKPT_MOE=$WORK/$SHAPE_MOE
mkdir -p "$OUT" "$RES"
LOG=$RES/progress.log

TAIL=12
source tools/steps.sh  # log, left, step
checkpoint() {  # checkpoint SHAPE DIR
  if [ -f "$2/config.json" ] && [ "${REBUILD:-0}" != 1 ] && ls "$2"/*.safetensors > /dev/null 2>&1; then
    log "checkpoint: reusing $2"
  else
    step "checkpoint_$1" 300 python3 tools/make_random_checkpoint.py --shape "$1" --out "$2"
  fi
}
has() { [[ "$PART" == all || "$PART" == *"$1"* ]]; }

log "parallel run: part $PART, shape $SHAPE, budget ${BUDGET_S}s, results in $OUT"
{ command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    && nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-', 'gpus', torch.cuda.device_count())"
  sources_hash; } > "$RES/machine.txt" 2>&1
cat "$RES/machine.txt"

COMMON=(--model "$CKPT" --skip-tokenizer-init "${ENGINE_FLAGS[@]}")
if has check || has throughput || has pp; then checkpoint "$SHAPE" "$CKPT"; fi
# Each layout's check and decode engines in their own process (tools/parallel_bench.py --part), then the table.
check_layouts() {  # check_layouts NAME LAYOUTS [LAYOUTS_TO_RUN (default: all; the others' parts are there)]
  local layout phase run=${3:-$2}
  for layout in ${run//,/ }; do
    for phase in check decode; do
      step "${1}_${layout/:/_}_$phase" 150 python3 tools/parallel_bench.py --model "$CKPT" --layouts "$2" \
        --input-len "$IN_LEN" --output-len "$OUT_LEN" --iters "$ITERS" "${CHECK[@]}" --out "$RES/$1.json" \
        --part "$layout:$phase" --profile-steps "$PROFILE_STEPS"
      # (the driver left without stopping its workers: they follow it out; wait until their memory is free)
      for _ in $(seq 60); do pgrep -f multiprocessing > /dev/null || break; sleep 0.5; done
    done
  done
  step "$1" 30 python3 tools/parallel_bench.py --model "$CKPT" --layouts "$2" --out "$RES/$1.json" --merge \
    --input-len "$IN_LEN" --output-len "$OUT_LEN" "${CHECK[@]}"  # (the table's header names them)
}
if has check; then
  # (2x1:symm_mem: the experimental symmetric-memory all-reduce, --tuning tp_all_reduce=symm_mem)
  check_layouts check_tp2 "1x1,2x1${SYMM-,2x1:symm_mem}"
fi
if has throughput; then
  for tp in 1 2; do
    step "throughput_tp$tp" 240 python3 -m atlas.cli bench throughput "${COMMON[@]}" -tp "$tp" \
      --num-prompts "$NUM_PROMPTS" --input-len "$TP_IN" --output-len "$TP_OUT" --output-json "$RES/throughput_tp$tp.json"
  done
fi
if has pp; then
  # (1x2:eager: the stages without their CUDA graphs, --tuning pp_graphs=0)
  if [ -f "$RES/check_tp2.json.parts/1x1_check.json" ] && [ -f "$RES/check_tp2.json.parts/1x1_decode.json" ]; then
    mkdir -p "$RES/check_pp2.json.parts" && cp "$RES"/check_tp2.json.parts/1x1_* "$RES/check_pp2.json.parts/"
    check_layouts check_pp2 1x1,1x2,1x2:eager 1x2,1x2:eager  # (one device's parts from the TP check of this run)
  else
    check_layouts check_pp2 1x1,1x2,1x2:eager
  fi
  if [ "${PP_THROUGHPUT:-1}" = 1 ]; then
    step throughput_pp2 240 python3 -m atlas.cli bench throughput "${COMMON[@]}" -pp 2 \
      --num-prompts "$NUM_PROMPTS" --input-len "$TP_IN" --output-len "$TP_OUT" --output-json "$RES/throughput_pp2.json"
    step throughput_pp2_eager 240 python3 -m atlas.cli bench throughput "${COMMON[@]}" -pp 2 --tuning pp_graphs=0 \
      --num-prompts "$NUM_PROMPTS" --input-len "$TP_IN" --output-len "$TP_OUT" \
      --output-json "$RES/throughput_pp2_eager.json"
  fi
fi
if has spec; then
  for layout in ${SPEC_LAYOUTS:-tp1 tp2 pp2}; do  # (tp1: -tp 1, pp2: -pp 2)
    step "spec_$layout" 200 python3 -m atlas.cli bench spec --methods ngram,dflash --concurrency 1,16 \
      "-${layout:0:2}" "${layout:2}" $([ "${DRY_RUN:-0}" = 1 ] \
        && echo --kv-cache-memory 64MiB --output-len 16 --waves 1 --min-prompts 4 \
        || echo --gpu-memory-utilization 0.2) --output-json "$RES/spec_$layout.json"
  done
fi
if has ep; then
  # Routed experts at TP=2: each rank holds a slice of every expert (default), or half the experts whole.
  checkpoint "$SHAPE_MOE" "$CKPT_MOE"
  for mode in sharded ep; do
    step "ep_tp2_$mode" 200 python3 -m atlas.cli bench latency --model "$CKPT_MOE" --skip-tokenizer-init \
      "${ENGINE_FLAGS[@]}" -tp 2 $([ $mode = ep ] && echo --enable-expert-parallel) --batch-size "${EP_BATCHES:-1,64}" \
      --input-len "$IN_LEN" --output-len "$OUT_LEN" --num-iters "$ITERS" --num-iters-warmup 1 --peer none \
      --output-json "$RES/ep_tp2_$mode.json"
  done
fi
if has serve32b; then
  if [ "${DRY_RUN:-0}" = 1 ]; then
    CKPT_32B=atlas/assets/default-model  # (a model with its tokenizer, small enough for a CPU)
  else
    checkpoint "$SHAPE_32B" "$CKPT_32B"
    # Text prompts need a tokenizer: the built-in model's (its 8192 ids are all inside the 32B vocabulary).
    cp atlas/assets/default-model/tokenizer.json atlas/assets/default-model/tokenizer_config.json "$CKPT_32B/"
  fi
  step serve_32b_tp2 480 python3 -m atlas.cli bench serve --model "$CKPT_32B" "${ENGINE_FLAGS[@]}" -tp 2 \
    --num-requests "$SERVE_REQUESTS" --concurrency "$SERVE_CONCURRENCY" --max-tokens "$SERVE_TOKENS" \
    --server-log "$RES/serve_32b_server.log" --output-json "$RES/serve_32b_tp2.json"
fi

# Throughput ratios against TP=1 of the same machine session (part throughput), when both are there.
python3 - "$RES" > "$RES/ratios.txt" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
def tput(name):
    p = res / f"{name}.json"
    if not p.is_file():
        return None
    return json.loads(p.read_text()).get("output_tokens_per_second")
base = tput("throughput_tp1")
for name in ("throughput_tp2", "throughput_pp2", "throughput_pp2_eager"):
    v = tput(name)
    if v and base:
        print(f"{name}: {v:.1f} output tok/s, {v / base:.2f}x TP=1 ({base:.1f})")
EOF

{
  echo "Atlas parallel run, part $PART, shape $SHAPE, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - START )) s"
  cat "$RES/machine.txt"
  echo; cat "$LOG"
  for f in check_tp2 throughput_tp1 throughput_tp2 check_pp2 throughput_pp2 throughput_pp2_eager spec_tp1 spec_tp2 spec_pp2 ep_tp2_sharded ep_tp2_ep serve_32b_tp2 ratios; do
    if [ -f "$RES/$f.txt" ]; then echo; echo "== $f"; cat "$RES/$f.txt"; fi
  done
} > "$RES/summary.txt" 2>&1
cp "$RES/summary.txt" "$OUT/summary.txt"
python3 - "$RES" "$OUT/results.json" <<'EOF'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
merged = {}
for p in sorted(res.glob("*.json")):
    try:
        merged[p.stem] = json.loads(p.read_text())
    except ValueError:
        pass
Path(sys.argv[2]).write_text(json.dumps(merged, indent=1))
EOF
tar -czf "$OUT/parallel_logs.tar.gz" -C "$WORK" results
echo; echo "================ summary"; cat "$RES/summary.txt"
log "done: $(ls -la "$OUT" | tail -n +2 | awk '{print $5, $9}' | tr '\n' ' ')"
