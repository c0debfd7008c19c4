#!/usr/bin/env bash
# Prepared in session 52 (no device time was left to run it): DeepSeek sparse attention (V3.2, GLM-5) now replays
# decode and verify steps from CUDA graphs captured per batch size and bound on the step's longest context
# (models/deepseek.py graph_context_buckets, runtime/cuda_graphs.py). (1) The DSA CUDA tests (the new graph test
# in test_dsa_triton.py, MTP in graphs, the models); (2) BENCHMARKS.md 13's batch-1 figures at 2k and 16k again
# (session 52 call 1: 32.1 and 24.8 ms a step eagerly, the dense-MLA twin 3.84 and 4.3 ms).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 240 python3 -m pytest -q -m cuda tests/test_dsa_triton.py tests/test_dsa_mtp.py tests/test_deepseek_cuda.py -n 3 \
  -p no:cacheprovider -rfE > $OUT/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $OUT/tests.log; grep -E "^FAILED" $OUT/tests.log | head
OUT=$OUT CONTEXTS="2048 16384" timeout 300 bash tools/gpu_dsa.sh > $OUT/gpu_dsa.log 2>&1
echo "exit $?" >> $OUT/gpu_dsa.log
grep -E "^== |atlas batch 1:|exit|captured" $OUT/gpu_dsa.log
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
