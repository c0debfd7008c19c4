#!/usr/bin/env bash
# Prepared in session 56 (its device time was spent), one pytest session after the other (session 56 call 5's two
# side by side ran out of GPU memory). (1) Every hybrid CUDA test with the new default (--tuning
# mixed_graph_recurrent_rows 128: the tests that do not set it now take the mixed-step graphs); resolve issue 40 when
# they pass. (2) The DSA / MTP CUDA tests on session 56's final tree (they passed on 0f7433e; the MTP modules'
# compute_logits split and the MoE capture check came after); resolve issue 42 when they pass. The FP8 CUDA tests are
# call 2's.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests hybrid 300 6 tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py
cuda_tests dsa_mtp 240 3 tests/test_dsa_mtp.py tests/test_dsa_triton.py tests/test_deepseek_cuda.py
