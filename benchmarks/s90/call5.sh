#!/usr/bin/env bash
# Session 90, call 5 (carry [".whl"]; ~2.5 min): the one-row GEMVs of the MoE families at batch 1 with each weight
# shape's config timed at load (`--tuning gemv=auto`, kernels/gemv.py) against the fixed default, alternated:
# gpt-oss-20b's q|k|v, o and router GEMVs are small (24-30 MB) and ran at 0.61 of the copy rate on an H200 (call 4).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh; FINAL=$OUT; OUT=/tmp/s90e; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
for s in gpt-oss-20b deepseek-v2-lite; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
lat() { latency_rows "$1" "/tmp/$2" "${@:3}"; tar czf $FINAL/s90_gemv.tgz -C /tmp s90e; }
lat oss_d1 gpt-oss-20b 1; lat oss_auto gpt-oss-20b 1 --tuning gemv=auto; lat oss_d2 gpt-oss-20b 1
lat v2_d deepseek-v2-lite 1; lat v2_auto deepseek-v2-lite 1 --tuning gemv=auto; lat v2_d2 deepseek-v2-lite 1
grep -h -i "gemv" $OUT/*.log | sort | uniq -c | head -20
echo "done at ${SECONDS}s"
