#!/usr/bin/env bash
# MTP on one GPU, from the repo root: train the small DeepSeek-V3-architecture model with its MTP module on
# the default model's corpus (tools/train_mtp_model.py), then `atlas bench spec --methods mtp` against plain
# decoding at concurrency 1 and 16, in bfloat16 and in float32 (greedy equality in each).
# Results: $OUT/mtp_results.tar.gz (train_report.json, train.log, config.json, spec_mtp_{bfloat16,float32}.*)
# and $OUT/mtp_summary.txt (two files: a call brings back at most eight).
# Knobs: MTP_MINUTES (training budget, default 5), STDLIB_DIR (the corpus' standard library), K (drafts, 3),
# TRAIN_ARGS (more flags for train_mtp_model.py), BENCH_ARGS (more flags for atlas bench spec).
# CPU dry run: TRAIN_ARGS="--device cpu --max-steps 4 --corpus-limit-mb 0.2 --hidden-size 32 --num-layers 2
#   --seq-len 64 --batch-size 4 --eval-prompts 2" BENCH_ARGS="--kv-cache-memory 64MiB --input-len 32
#   --output-len 8 --waves 1 --min-prompts 4" OUT=/tmp/mtp-out bash tools/gpu_mtp.sh
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source tools/device_site.sh
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-/tmp/mtp-model}
RES=${RES:-/tmp/mtp-results}
rm -rf "$RES" && mkdir -p "$RES" "$OUT"
STDLIB=()
[ -n "${STDLIB_DIR:-}" ] && STDLIB=(--stdlib-dir "$STDLIB_DIR")
python3 tools/train_mtp_model.py --out "$MODEL" --time-budget-minutes "${MTP_MINUTES:-5}" "${STDLIB[@]}" ${TRAIN_ARGS:-} \
  > "$RES/train.out" 2>&1 || echo "training failed: see train.out"
cp "$MODEL"/train_report.json "$MODEL"/train.log "$MODEL"/config.json "$RES/" 2>/dev/null
du -sh "$MODEL" > "$RES/size.txt" 2>&1
for dtype in bfloat16 float32; do
  timeout 120 python3 -m atlas.cli bench spec --model "$MODEL" --methods mtp --num-draft-tokens "${K:-3}" \
    --concurrency 1,16 --prompts heldout-code "${STDLIB[@]}" --dtype "$dtype" \
    ${BENCH_ARGS:---gpu-memory-utilization 0.1} \
    --output-json "$RES/spec_mtp_$dtype.json" > "$RES/spec_mtp_$dtype.log" 2>&1
  tail -6 "$RES/spec_mtp_$dtype.log"
done
{ grep -E "held-out|engine:" "$RES/train.out" | tail -3; for f in "$RES"/spec_mtp_*.txt; do echo; cat "$f"; done; } \
  > "$OUT/mtp_summary.txt" 2>&1
tar -czf "$OUT/mtp_results.tar.gz" -C "$RES" .
