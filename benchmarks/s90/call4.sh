#!/usr/bin/env bash
# Session 90, call 4 (carry [".whl"]; ~70 s on an H200): gpt-oss-20b's and DeepSeek-V2-Lite's batch-1 steps profiled
# with PDL off (`--profile`: kernels a step by kind, the device's idle gaps, host time by stage). Files: call4/.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh; FINAL=$OUT; OUT=/tmp/s90d; mkdir -p $OUT
for s in gpt-oss-20b deepseek-v2-lite; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
latency_rows prof_oss /tmp/gpt-oss-20b 1 --profile $OUT/prof_oss --tuning pdl=0
latency_rows prof_v2 /tmp/deepseek-v2-lite 1 --profile $OUT/prof_v2 --tuning pdl=0
tar czf $FINAL/s90_prof.tgz -C /tmp s90d; echo "done at ${SECONDS}s"
