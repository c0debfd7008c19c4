#!/usr/bin/env bash
# Session 59 call 3, after 4089429 (the wall-time test reads shrunk whole-life acceptance means). Carry [".whl", ".stdlib"].
# (1) The built-in model and drafter, BENCHMARKS 3.1's commands (held-out code, 128 in / 128 out, 16 waves, 3 interleaved
#     passes): waves at 16 and 1 under the adaptive default and under `always`; continuous at 16 under the default
#     (issue 38's bar: the best of n-gram / DFlash no worse than 2.81x at 1 and 2.00x at 16).
# (2) The 8B shape with random weights, n-gram and the random DFlash drafter at 16 and 64 (the 0.97x bar in waves,
#     where the wall-time test applies).
# (3) The policy's CUDA tests.
mkdir -p $OUT /tmp/logs /tmp/stdlib
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
tar -xJf .stdlib/stdlib-3.11.7.tar.xz -C /tmp/stdlib
spec() {  # NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m atlas.cli bench spec --methods ngram,dflash --gpu-memory-utilization 0.1 --waves 16 \
    --repeats 3 --interleave --stdlib-dir /tmp/stdlib "$@" --output-json "$OUT/$name.json" > "/tmp/logs/$name.log" 2>&1
  echo "$name: exit $?"; grep -A12 "^method" "/tmp/logs/$name.log" | cut -c1-200
}
spec shipped_waves_adaptive 150 --concurrency 16,1 --schedule waves
spec shipped_continuous_adaptive 120 --concurrency 16 --schedule continuous
spec shipped_waves_always 150 --concurrency 16,1 --schedule waves --speculative-policy always
OUT=$OUT/q8 POLICIES=adaptive METHODS=ngram,dflash CONC=16,64 EXTRA="--repeats 2" timeout 200 bash tools/gpu_spec_policy.sh
cuda_tests policy 100 1 tests/test_speculation_policy.py
cp /tmp/logs/*.log $OUT/ 2>/dev/null; cd $OUT && tar czf all.tgz --exclude=all.tgz . 
