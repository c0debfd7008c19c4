#!/usr/bin/env bash
# Device call 7 (session 47): the CUDA tests of this session's changes, in the device time left after call 5 lost
# its machine: the 8-bit MLA / DSA latent cache (test_mla_kv_cache_dtype) and the MLA kernel's own cases
# (test_deepseek_cuda -k mla), the MoE families' FP8 linear layers (test_moe_fp8: DeepSeek-V3 in CUDA graphs against
# eager), the sliding-window KV cache groups (test_kv_groups, and the windowed models' CUDA files), the GQA 8-bit
# cache. One line a test (-v), so that a run cut by the limit still says what passed.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout -k 5 ${LIMIT:-200} python3 -m pytest -v -m cuda -n 3 -p no:cacheprovider -rfE \
  tests/test_mla_kv_cache_dtype.py tests/test_moe_fp8.py tests/test_kv_groups.py tests/test_sliding_window_cuda.py \
  tests/test_gpt_oss_cuda.py tests/test_kv_cache_dtype.py "tests/test_deepseek_cuda.py::test_triton_mla_attention_matches_reference" \
  > $OUT/cuda_tests.log 2>&1
echo "exit $?" >> $OUT/cuda_tests.log
grep -E "PASSED|FAILED|ERROR|passed|failed|exit" $OUT/cuda_tests.log | sed -E 's/^\[gw[0-9]\] \[ *[0-9]+%\] //' | tail -n 60
