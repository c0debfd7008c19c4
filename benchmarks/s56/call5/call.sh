#!/usr/bin/env bash
# Session 56 call 5: the FP8 CUDA tests and the DSA / MTP CUDA tests after SMALL_M went from 64 to 8 (rows 9-64 of an
# FP8 linear layer take the W8A8 path; call 4).
mkdir -p $OUT; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh
timeout 200 python3 -m pytest -q -m cuda tests/test_dsa_mtp.py tests/test_dsa_triton.py tests/test_deepseek_cuda.py \
  -n 3 -p no:cacheprovider -rfE > $OUT/tests_dsa_mtp.log 2>&1 &
dsa=$!
timeout 200 python3 -m pytest -q -m cuda tests/test_fp8_cuda.py tests/test_moe_fp8.py -n 4 -p no:cacheprovider -rfE \
  > $OUT/tests_fp8.log 2>&1
echo "FP8 tests exit $?"; grep -E "passed|failed" $OUT/tests_fp8.log | tail -n 1; grep -E "^FAILED|^ERROR" $OUT/tests_fp8.log | head
wait $dsa; echo "DSA / MTP tests exit $?"; grep -E "passed|failed" $OUT/tests_dsa_mtp.log | tail -n 1
