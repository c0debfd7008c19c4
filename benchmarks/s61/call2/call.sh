#!/usr/bin/env bash
# Session 61 call 2: the drafters' CUDA tests by name (call 1's were cut at 170 s after 7 passed), with the
# assertions that EAGLE-3's and MTP's drafts were queued right behind the verify steps. Carry [".whl"].
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 420 python3 -m pytest -v -m cuda -k "mtp or eagle3 or drafting or decode_steps" -n 4 -p no:cacheprovider -rfE \
  tests/test_eagle3.py tests/test_draft_model_proposer.py tests/test_deepseek_cuda.py tests/test_dsa_mtp.py \
  tests/test_hybrid_mtp.py tests/test_mla_kv_cache_dtype.py > $OUT/tests_drafters.log 2>&1
echo "tests exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests_drafters.log | cut -c1-200 | tail -20
