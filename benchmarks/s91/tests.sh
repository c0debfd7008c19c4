#!/usr/bin/env bash
# Session 91: the CUDA tests owed since sessions 88-90's kernel, layer and policy changes, on whatever card comes
# (carry [".whl"]; ~6 min): the MXFP4 kernels' cases (tests/moe_mxfp4_cases.py, the scales' fold on by default since
# f98b1d2), the gpt-oss model's and the speculation policy's CUDA tests (f9c4cb2). Files: $OUT/s91_tests.tgz.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh; FINAL=$OUT; OUT=/tmp/s91t; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
(cd tests && timeout 200 python3 moe_mxfp4_cases.py gpt-oss-20b > $OUT/moe_mxfp4_cases.log 2>&1
 echo "moe_mxfp4_cases exit $? at ${SECONDS}s"; tail -n 4 $OUT/moe_mxfp4_cases.log)
tar czf $FINAL/s91_tests.tgz -C /tmp s91t
cuda_tests oss_policy $(( 570 - SECONDS )) 2 tests/test_gpt_oss_cuda.py tests/test_speculation_policy.py
tar czf $FINAL/s91_tests.tgz -C /tmp s91t; echo "done at ${SECONDS}s"
