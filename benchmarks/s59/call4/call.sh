#!/usr/bin/env bash
# Session 59 call 4, after the commit where an empty proposal for a lone request counts as a plain step. Carry
# [".whl", ".stdlib"]. (1) The built-in model, waves at 16 and 1 under the adaptive default (call 3's first command);
# (2) the 8B shape, n-gram on random prompts at 1 and 16 (the 0.97x bar: n-gram rarely matches there);
# (3) the policy's CUDA tests.
mkdir -p $OUT /tmp/logs /tmp/stdlib
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
tar -xJf .stdlib/stdlib-3.11.7.tar.xz -C /tmp/stdlib
timeout 150 python3 -m atlas.cli bench spec --methods ngram,dflash --gpu-memory-utilization 0.1 --waves 16 --repeats 3 \
  --interleave --stdlib-dir /tmp/stdlib --concurrency 16,1 --schedule waves --output-json $OUT/shipped_waves_adaptive.json \
  > /tmp/logs/shipped_waves_adaptive.log 2>&1
echo "shipped_waves_adaptive: exit $?"; grep -A8 "^method" /tmp/logs/shipped_waves_adaptive.log | cut -c1-200
OUT=$OUT/q8 POLICIES=adaptive METHODS=ngram CONC=1,16 EXTRA="--repeats 3" timeout 200 bash tools/gpu_spec_policy.sh
cuda_tests policy 100 1 tests/test_speculation_policy.py
cp /tmp/logs/*.log $OUT/ 2>/dev/null; tar czf /tmp/all.tgz -C $OUT . && mv /tmp/all.tgz $OUT/
