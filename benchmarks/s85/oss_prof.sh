#!/usr/bin/env bash
# Session 85 (carry [".whl"]; ~4 min): where gpt-oss-20b's decode step goes at 64 and 256 requests (0.418 and 0.242
# of its roofline on an H100 in session 84): `atlas bench latency --profile` (kernels a step, time by kind, idle gaps)
# on the --config-only checkpoint, --load-format dummy, then the same at batch 256 with the grouped kernel's row chunk
# at 16 and 64 (moe_grouped_block_m) against the default (mean rows an expert, 32 here).
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
lat() {  # NAME BATCHES LIMIT [extra args...]
  local name=$1 batches=$2 limit=$3; shift 3
  timeout $limit python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size $batches --input-len 128 \
    --output-len 64 --num-iters 3 --num-iters-warmup 1 --output-json /tmp/p/lat_$name.json "$@" > /tmp/p/lat_$name.log 2>&1
  echo "$name: exit $?; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" /tmp/p/lat_$name.json 2>/dev/null)"
}
lat prof256 256 150 --profile /tmp/p/prof256
head -n 45 /tmp/p/prof256/latency_*_summary.txt 2>/dev/null | cut -c1-170
lat prof64 64 120 --profile /tmp/p/prof64
head -n 30 /tmp/p/prof64/latency_*_summary.txt 2>/dev/null | cut -c1-170
for m in 16 64 0; do lat bm$m 256 90 --tuning moe_grouped_block_m=$m; done
find /tmp/p -name "*.json*" -size +15M -delete
tar czf $OUT/oss.tgz -C /tmp p
echo "done at ${SECONDS}s"
