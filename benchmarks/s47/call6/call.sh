#!/usr/bin/env bash
# Device call 6 (session 47): call 5 lost its machine part-way (no results came back, and most of the session's
# device time with it), so only the CUDA tests of the kernels this session changed: the 8-bit MLA / DSA latent
# cache (tests/test_mla_kv_cache_dtype.py), the MLA kernel's other tests (test_deepseek_cuda) and the GQA 8-bit cache
# whose rounding helper the MLA write now shares (test_kv_cache_dtype).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout -k 10 ${LIMIT:-260} python3 -m pytest -q -m cuda tests/test_mla_kv_cache_dtype.py tests/test_deepseek_cuda.py \
  tests/test_kv_cache_dtype.py -n 2 -p no:cacheprovider -rfE --durations=10 > $OUT/cuda_tests.log 2>&1
echo "exit $?" >> $OUT/cuda_tests.log
tail -n 30 $OUT/cuda_tests.log
