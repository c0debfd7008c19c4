#!/usr/bin/env bash
# Device call 3 (session 43), on call 1's sources: the files call 2 did not reach, and the two CUDA tests written in
# session 42 (the DSA and hybrid MTP drafters). The device tool's command line, as a script.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
WORK=/tmp/c3 FILES="dflash:25 speculation_policy:18 mixed_graphs:12 dsa_mtp:40 hybrid_mtp:40" timeout 250 \
  bash tools/gpu_tests.sh > /tmp/c3.log 2>&1
cat "${OUT:-/tmp/out}/cuda_tests.txt"
