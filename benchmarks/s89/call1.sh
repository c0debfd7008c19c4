#!/usr/bin/env bash
# Session 89, one call (carry [".whl"]; ~8.5 min, any card): gpt-oss-20b's batch-1 step with the MXFP4 one-token
# kernels' FMA decodes (moe_mxfp4_decode=words-fma: W's int32 words, a mask, a multiply and a mask a code; pairs-fma:
# pairs' decode; both summing each thread's products as fused multiply-add chains): words-fma in both kernels, down on
# 8 warps or, by moe_mxfp4_row_steps' fifth field, 4; and gate|up in words-fma with down in pairs-fma on 4 warps;
# against the default pairs decode, alternated; then the MXFP4 kernel cases on this GPU (tests/moe_mxfp4_cases.py gpt-oss-20b: every decode form and kernel against the references) and the
# gpt-oss model's CUDA tests (owed since moe_grouped_gather became the default). Timings first.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/gpt-oss-20b --config-only > /dev/null
FINAL=$OUT; OUT=/tmp/s89; mkdir -p $OUT  # (every file into one archive at the end: few files come back)
W="--tuning moe_mxfp4_decode=words-fma"
W4="--tuning moe_mxfp4_decode=words-fma,moe_mxfp4_row_steps=down:0:1:words-fma:4"
M="--tuning moe_mxfp4_row_steps=gate_up:0:1:words-fma;down:0:1:pairs-fma:4"
lat() { latency_rows "$1" /tmp/gpt-oss-20b "${@:2}"; }
lat pairs1 1; lat words1 1 $W; lat mix1 1 $M; lat words4_1 1 $W4; lat pairs2 1; lat mix2 1 $M
tar czf $FINAL/s89_call1.tgz -C /tmp s89  # (the timings, should the rest be cut)
(cd tests && timeout 130 python3 moe_mxfp4_cases.py gpt-oss-20b > $OUT/moe_mxfp4_cases.log 2>&1; echo "moe_mxfp4_cases exit $?"; tail -n 4 $OUT/moe_mxfp4_cases.log)
cuda_tests gpt_oss 150 2 tests/test_gpt_oss_cuda.py
tar czf $FINAL/s89_call1.tgz -C /tmp s89
echo "done at ${SECONDS}s"
