#!/usr/bin/env bash
# Prepared in session 51 for the next GPU session: DSA decode steps split each row's selected rows over more
# programs (kernels/dsa_attention.py; session 51 call 3 measured the unsplit `_dsa_sparse_mla_kernel` at 255 us a
# layer at batch 1, two programs for 2,048 rows). (1) The DSA CUDA tests (the kernels against the reference, now
# also over 2 and 4 splits at V3.2's shapes; the models in CUDA eagerly). (2) The batch-1 figures and profiles of
# BENCHMARKS.md 13 again at 2k and 16k: the split kernel's share of the step (session 51: 2.0 ms of 7.1 busy).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 240 python3 -m pytest -q -m cuda tests/test_dsa_triton.py tests/test_dsa_mtp.py tests/test_deepseek_cuda.py tests/test_mla_kv_cache_dtype.py -n 3 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $OUT/tests.log
OUT=$OUT CONTEXTS="2048 16384" timeout 300 bash tools/gpu_dsa.sh > $OUT/gpu_dsa.log 2>&1
echo "exit $?" >> $OUT/gpu_dsa.log
grep -E "^== |atlas batch 1:|exit" $OUT/gpu_dsa.log
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
