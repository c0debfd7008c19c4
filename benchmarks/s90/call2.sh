#!/usr/bin/env bash
# Session 90, call 2 (carry [".whl"]; ~5 min, an H200 here; run on 68cc521, the fold off by default then): gpt-oss-20b
# at batch 1 with the row tiles' defaults against the grouped tensor-core kernel at one token (moe_pairs_max_tokens=0
# with the one-program sort and the activation epilogue; with and without the scales' fold) and pairs-fma in both
# one-token kernels (down on 4 warps); at 64 and 256 requests the scales' fold (moe_mxfp4_fold) off and on,
# alternated twice; then the MXFP4 kernels' CUDA cases and the gpt-oss model's CUDA tests. Files: call2/.
mkdir -p $OUT; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh
FINAL=$OUT; OUT=/tmp/s90b; mkdir -p $OUT; nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/gpt-oss-20b --config-only > /dev/null
lat() { latency_rows "$1" "/tmp/$2" "${@:3}"; tar czf $FINAL/s90_second.tgz -C /tmp s90b; }
G="--tuning moe_pairs_max_tokens=0,moe_expert_sort=1,moe_grouped_act=1,moe_mxfp4_fold=1"
G0="--tuning moe_pairs_max_tokens=0,moe_expert_sort=1,moe_grouped_act=1"
F="--tuning moe_mxfp4_fold=1"; M="--tuning moe_mxfp4_row_steps=gate_up:0:1:pairs-fma;down:0:1:pairs-fma:4"
lat p1 gpt-oss-20b 1; lat g1 gpt-oss-20b 1 $G; lat g0 gpt-oss-20b 1 $G0; lat pf gpt-oss-20b 1 $M
lat many gpt-oss-20b 64,256; lat many_fold gpt-oss-20b 64,256 $F; lat many2 gpt-oss-20b 64,256
lat many_fold2 gpt-oss-20b 64,256 $F; lat p2 gpt-oss-20b 1
(cd tests && timeout 200 python3 moe_mxfp4_cases.py gpt-oss-20b > $OUT/moe_mxfp4_cases.log 2>&1; echo "moe_mxfp4_cases exit $?"; tail -n 4 $OUT/moe_mxfp4_cases.log)
tar czf $FINAL/s90_second.tgz -C /tmp s90b
left=$(( 480 - SECONDS )); [ $left -gt 30 ] && cuda_tests gpt_oss $left 2 tests/test_gpt_oss_cuda.py
tar czf $FINAL/s90_second.tgz -C /tmp s90b; echo "done at ${SECONDS}s"
