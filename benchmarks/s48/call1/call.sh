#!/usr/bin/env bash
# Next GPU session, call 1: the eight CUDA tests that failed in session 47's call 7 under three workers, cut by the
# call's limit before pytest printed why (each makes two or three engines of 0.2-0.3 of the GPU while the other
# workers hold theirs: the memory plan's refusal; the engines are now 0.15 each and given back in turn), alone, with
# test_deepseek_cuda (not reached in call 7; its random page tables now come from mla_attention_cases). Then, in a
# second call, the whole CUDA suite: benchmarks/s46/call1/call.sh.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout -k 5 ${LIMIT:-300} python3 -m pytest -q -m cuda -p no:cacheprovider -rfE \
  "tests/test_moe_fp8.py" "tests/test_kv_groups.py" "tests/test_mla_kv_cache_dtype.py" \
  "tests/test_sliding_window_cuda.py::test_long_generation_on_cuda_holds_bounded_pages_and_equals_transformers" \
  "tests/test_sliding_window_cuda.py::test_ngram_speculation_equals_plain_greedy_on_cuda" \
  "tests/test_gpt_oss_cuda.py::test_ngram_speculation_equals_plain_greedy_fp32" \
  "tests/test_gpt_oss_cuda.py::test_gpt_oss_20b_shape_runs_with_dummy_weights" tests/test_deepseek_cuda.py \
  > $OUT/cuda_alone.log 2>&1
echo "exit $?" >> $OUT/cuda_alone.log
tail -n 30 $OUT/cuda_alone.log
