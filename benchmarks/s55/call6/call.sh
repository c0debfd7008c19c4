#!/usr/bin/env bash
# Session 55, the last of its device time: hybrid models' mixed steps from CUDA graphs (--tuning
# mixed_graph_recurrent_rows, off by default): the CUDA tests of the new kernel forms (row counts with in-step
# snapshots, the convolution's states written into the pool) and of fp32 tokens against transformers with those
# graphs and prefix caching.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 150 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py -k "mixed_step" -n 3 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "tests exit $?"; grep -E "passed|failed" $OUT/tests.log | tail -n 1; grep -E "^FAILED|^ERROR|Error" $OUT/tests.log | head
