#!/usr/bin/env bash
# MTP on one GPU, from the repo root: train the small DeepSeek-V3-architecture model with its MTP module on
# the default model's corpus (tools/train_mtp_model.py), then `atlas bench spec --methods mtp` against plain
# decoding at concurrency 1 and 16, in bfloat16 and in float32 (greedy equality in each).
# Results under $OUT/mtp: train_report.json, train.log, config.json, spec_mtp_{bf16,fp32}.{json,txt}.
# Knobs: MTP_MINUTES (training budget, default 5), STDLIB_DIR (the corpus' standard library), K (drafts, 3).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-/tmp/mtp-model}
mkdir -p "$OUT/mtp"
STDLIB=()
[ -n "${STDLIB_DIR:-}" ] && STDLIB=(--stdlib-dir "$STDLIB_DIR")
python3 tools/train_mtp_model.py --out "$MODEL" --time-budget-minutes "${MTP_MINUTES:-5}" "${STDLIB[@]}" \
  > "$OUT/mtp/train.out" 2>&1 || echo "training failed: see train.out"
cp "$MODEL"/train_report.json "$MODEL"/train.log "$MODEL"/config.json "$OUT/mtp/" 2>/dev/null
du -sh "$MODEL" > "$OUT/mtp/size.txt" 2>&1
for dtype in bfloat16 float32; do
  timeout 120 python3 -m atlas.cli bench spec --model "$MODEL" --methods mtp --num-draft-tokens "${K:-3}" \
    --concurrency 1,16 --prompts heldout-code "${STDLIB[@]}" --dtype "$dtype" --gpu-memory-utilization 0.1 \
    --output-json "$OUT/mtp/spec_mtp_$dtype.json" > "$OUT/mtp/spec_mtp_$dtype.log" 2>&1
  tail -6 "$OUT/mtp/spec_mtp_$dtype.log"
done
