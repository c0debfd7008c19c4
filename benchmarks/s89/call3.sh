#!/usr/bin/env bash
# Session 89, the shortest form of call1.sh (carry [".whl"]; ~3.5 min, any card): gpt-oss-20b's batch-1 step with
# words-fma (down on 4 warps) and with gate|up in words-fma and down in pairs-fma on 4 warps, between two runs of the
# default pairs decode.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/gpt-oss-20b --config-only > /dev/null
FINAL=$OUT; OUT=/tmp/s89; mkdir -p $OUT
W4="--tuning moe_mxfp4_decode=words-fma,moe_mxfp4_row_steps=down:0:1:words-fma:4"
M="--tuning moe_mxfp4_row_steps=gate_up:0:1:words-fma;down:0:1:pairs-fma:4"
lat() { latency_rows "$1" /tmp/gpt-oss-20b "${@:2}"; tar czf $FINAL/s89_call3.tgz -C /tmp s89; }
lat pairs1 1; lat words4_1 1 $W4; lat mix1 1 $M; lat pairs2 1
echo "done at ${SECONDS}s"
