#!/usr/bin/env bash
# Device call 5 (session 47): every CUDA test (pytest -m cuda) on the merge of the 8-bit MLA/DSA latent cache
# (new: tests/test_mla_kv_cache_dtype.py), after session 46's scheduler changes (0d4abdb, d13e454), three
# pytest-xdist workers on the one H200; then the files whose tests refused to plan a KV pool beside the other workers
# (OutOfMemoryPlanError) again, alone.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $OUT/machine.txt 2>&1
timeout -k 10 ${LIMIT:-400} python3 -m pytest -q -m cuda tests/ -n 3 -p no:cacheprovider -rfE --durations=15 \
  > $OUT/cuda_tests.log 2>&1
echo "exit $?" >> $OUT/cuda_tests.log
tail -n 40 $OUT/cuda_tests.log
# (every failing file again: the summary lines are cut before the error's name; a real failure fails again alone)
again=$(grep -E "^(FAILED|ERROR) " $OUT/cuda_tests.log | sed -E 's/^(FAILED|ERROR) ([^: ]+).*/\2/' | sort -u | tr '\n' ' ')
if [ -n "$again" ]; then
  echo "== alone: $again"
  timeout -k 10 ${LIMIT2:-170} python3 -m pytest -q -m cuda $again -p no:cacheprovider -rfE > $OUT/cuda_tests_alone.log 2>&1
  echo "exit $?" >> $OUT/cuda_tests_alone.log
  tail -n 15 $OUT/cuda_tests_alone.log
fi
