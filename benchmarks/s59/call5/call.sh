#!/usr/bin/env bash
# Session 59 call 5, after the policy's start-only margin, weight-0.25 running means and margin-short empty
# proposals. Carry [".whl", ".stdlib"]. (1) The built-in model, waves at 16 and 1, adaptive (calls 3 and 4's
# command); (2) the 8B shape, n-gram and the random DFlash drafter at 1 and 16 (the 0.97x bar); (3) the CUDA tests.
mkdir -p $OUT /tmp/logs /tmp/stdlib
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
tar -xJf .stdlib/stdlib-3.11.7.tar.xz -C /tmp/stdlib
timeout 120 python3 -m atlas.cli bench spec --methods ngram,dflash --gpu-memory-utilization 0.1 --waves 16 --repeats 3 \
  --interleave --stdlib-dir /tmp/stdlib --concurrency 16,1 --schedule waves --output-json $OUT/shipped_waves_adaptive.json \
  > /tmp/logs/shipped_waves_adaptive.log 2>&1
echo "shipped_waves_adaptive: exit $?"; grep -A8 "^method" /tmp/logs/shipped_waves_adaptive.log | cut -c1-200
OUT=$OUT/q8 POLICIES=adaptive METHODS=ngram,dflash CONC=1,16 EXTRA="--repeats 2" timeout 170 bash tools/gpu_spec_policy.sh
cuda_tests policy 80 1 tests/test_speculation_policy.py
cp /tmp/logs/*.log $OUT/ 2>/dev/null; tar czf /tmp/all.tgz -C $OUT . && mv /tmp/all.tgz $OUT/
