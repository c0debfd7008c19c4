#!/usr/bin/env bash
# Issue 42's DSA figures on one GPU, from the repo root: the DeepSeek-V3.2 shape cut to fit one GPU (random bf16
# weights drawn on the device, --load-format dummy) against the same model as dense MLA (its config with the
# indexer fields removed, DeepseekV3ForCausalLM: the same weights but the indexer's), batch-1 decode at each
# context of CONTEXTS and the TTFT of one prompt of the middle one, with torch.profiler summaries of the decode
# steps (where the indexer's share is read). Results: $OUT/dsa_*.json, their .txt tables, $OUT/dsa_profiles.tar.gz.
#
# Knobs: CONTEXTS ("2048 16384 65536"), OUT_LEN (decode steps timed, 32), SHAPE (deepseek-v3.2-cut), ITERS (2).
# CPU dry run with the tiny shape: DRY_RUN=1 OUT=/tmp/dsa bash tools/gpu_dsa.sh
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source tools/device_site.sh
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/atlas-dsa}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE=${SHAPE:-deepseek-v3.2-tiny} CONTEXTS=${CONTEXTS:-"32 96"} OUT_LEN=${OUT_LEN:-4} ITERS=${ITERS:-1}
  ENGINE_FLAGS=(--kv-cache-memory 64MiB --max-model-len 256)
else
  ENGINE_FLAGS=(--gpu-memory-utilization 0.85 --max-model-len 70000)
fi
SHAPE=${SHAPE:-deepseek-v3.2-cut} CONTEXTS=${CONTEXTS:-"2048 16384 65536"} OUT_LEN=${OUT_LEN:-32} ITERS=${ITERS:-2}
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
python3 tools/make_random_checkpoint.py --shape "$SHAPE" --out "$WORK/dsa" --config-only > "$WORK/make.log" 2>&1 || {
  cat "$WORK/make.log"; exit 1; }
# The dense twin: the same config as DeepSeek-V3 (MLA over every cached row), without the indexer.
python3 - "$WORK/dsa" "$WORK/dense" <<'PY'
import json, shutil, sys
src, dst = sys.argv[1:]
shutil.copytree(src, dst)
cfg = json.load(open(f"{dst}/config.json"))
for key in ("index_topk", "index_n_heads", "index_head_dim", "indexer_types", "index_topk_freq"):
    cfg.pop(key, None)
cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
json.dump(cfg, open(f"{dst}/config.json", "w"), indent=1)
PY
for model in dsa dense; do
  for ctx in $CONTEXTS; do
    name="dsa_${model}_ctx${ctx}"
    echo "== $name"
    python3 -m atlas.cli bench latency --model "$WORK/$model" --load-format dummy --skip-tokenizer-init \
      "${ENGINE_FLAGS[@]}" --batch-size 1 --input-len "$ctx" --output-len "$OUT_LEN" --num-iters "$ITERS" \
      --num-iters-warmup 1 --peer none --profile "$WORK/profiles/$name" --profile-steps 3 \
      --output-json "$OUT/$name.json" > "$WORK/$name.log" 2>&1
    echo "exit $?"; tail -4 "$WORK/$name.log"
  done
done
tar czf "$OUT/dsa_profiles.tar.gz" -C "$WORK" profiles $(cd "$WORK" && ls *.log)
