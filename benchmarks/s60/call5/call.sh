#!/usr/bin/env bash
# Session 60, call 5 (the command as run): call 4's CUDA tests were cut at 330 s after 66 of 67 passed; this names
# the new router tests and the two long dummy-shape tests one by one.
mkdir -p $OUT; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh
timeout 240 python3 -m pytest -v -m cuda -n 3 -p no:cacheprovider tests/test_moe_families.py tests/test_gpt_oss_cuda.py \
  tests/test_hybrid_cuda.py -k "dummy or single_row_routers" > $OUT/tests_rest.log 2>&1
