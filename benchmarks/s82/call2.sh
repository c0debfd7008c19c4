#!/usr/bin/env bash
# Session 82, call 2 (carry [".whl"]; ~8 min): issue 41's MoE-family rows on this card, one call, the same command
# as sections 7, 7.1 and 7.3 (`atlas bench latency`, `--config-only` checkpoints, `--load-format dummy`):
# (1) DeepSeek-V2-Lite's batch-1 step profiled (kernels a step, time by kind, the device's idle gaps), with the MLA
# prologue on and off, to say where the step's time beyond its floor goes; (2) V2-Lite, Qwen3-30B-A3B and gpt-oss-20b
# at batch 1, 64 and 256.
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for s in deepseek-v2-lite qwen3-30b-a3b gpt-oss-20b; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
lat() {  # NAME SHAPE BATCHES LIMIT [extra args...]
  local name=$1 shape=$2 batches=$3 limit=$4; shift 4
  timeout $limit python3 -m atlas.cli bench latency --model /tmp/$shape --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size $batches --input-len 128 \
    --output-len 64 --num-iters 3 --num-iters-warmup 1 --output-json /tmp/p/lat_$name.json "$@" > /tmp/p/lat_$name.log 2>&1
  echo "$name: exit $?; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" /tmp/p/lat_$name.json 2>/dev/null)"
}
lat v2_prof deepseek-v2-lite 1 120 --profile /tmp/p/prof_v2
head -n 40 /tmp/p/prof_v2/latency_*_summary.txt 2>/dev/null | cut -c1-170
lat v2_prof_off deepseek-v2-lite 1 120 --profile /tmp/p/prof_v2_off --tuning mla_fused_prologue=0
head -n 12 /tmp/p/prof_v2_off/latency_*_summary.txt 2>/dev/null | cut -c1-170
lat v2 deepseek-v2-lite 1,64,256 150
lat a3b qwen3-30b-a3b 1,64,256 150
lat oss gpt-oss-20b 1,64,256 150
find /tmp/p -name "*.json*" -size +15M -delete
tar czf $OUT/rows.tgz -C /tmp p
echo "done at ${SECONDS}s"
