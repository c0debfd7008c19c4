#!/usr/bin/env bash
# Device call 1 (session 46): every CUDA test (pytest -m cuda) after the scheduler -> runner snapshot (issue 37),
# three pytest-xdist workers on the one H200. Tests whose KV pool asks for more than the others leave free refuse
# (OutOfMemoryPlanError) and are run again alone: WORKERS=1 TESTS="tests/test_x.py ...".
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null; } > $OUT/machine.txt 2>&1
timeout -k 10 ${LIMIT:-540} python3 -m pytest -q -m cuda ${TESTS:-tests/} -n ${WORKERS:-3} -p no:cacheprovider -rfE \
  --durations=25 --junitxml=$OUT/cuda.xml ${ARGS:-} > $OUT/cuda_tests.log 2>&1
echo "exit $?" >> $OUT/cuda_tests.log
tail -n 60 $OUT/cuda_tests.log
