#!/usr/bin/env bash
# Prepared in session 56 (its device time was spent). (1) Every hybrid CUDA test with the new default
# (--tuning mixed_graph_recurrent_rows 128: the tests that do not set it now take the mixed-step graphs); resolve
# issue 40 when they pass. (2) The FP8 CUDA tests after SMALL_M 64 -> 8 and the FP8 models' 8-token mixed-step graph
# (session 56 call 5 failed the graphs-against-eager test before that graph; run alone: call 5's two pytest sessions
# side by side ran out of GPU memory).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests hybrid 300 6 tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py
cuda_tests fp8 200 3 tests/test_fp8_cuda.py tests/test_moe_fp8.py tests/test_mixed_graphs.py
