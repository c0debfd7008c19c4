#!/usr/bin/env bash
# session 39 call 1: serve at 256 streams (1 and 2 front ends), FP8 batch-1 sweep, FP8 CUDA tests, FP8 vs bf16
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader >> $S
echo "sources $(git rev-parse HEAD 2>/dev/null) $(date -u +%FT%TZ)" >> $S
t0=$(date +%s)
RUNS="256:1024:1 256:1024:2" OUT=$OUT/serve bash tools/gpu_serve.sh > $OUT/serve.out 2>&1
grep -A7 "^serve_" $OUT/serve.out | grep -v "INFO" >> $S
echo "serve in $(( $(date +%s) - t0 )) s" >> $S; t0=$(date +%s)
CONFIGS="sum-n4k2048w4s3 xs-n8k128w8s4" OUT=$OUT/sweep bash tools/gpu_fp8_model_sweep.sh > $OUT/sweep.out 2>&1
cat $OUT/sweep/fp8_sweep.txt >> $S
echo "sweep in $(( $(date +%s) - t0 )) s" >> $S; t0=$(date +%s)
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -m cuda tests/test_fp8_cuda.py -p no:cacheprovider -rfE > $OUT/fp8_tests.txt 2>&1
echo "fp8 tests exit $?: $(tail -1 $OUT/fp8_tests.txt) in $(( $(date +%s) - t0 )) s" >> $S; t0=$(date +%s)
VARIANTS="bf16 block" OUT=$OUT/fp8 timeout 200 bash tools/gpu_fp8.sh > $OUT/fp8.out 2>&1
cat $OUT/fp8.out >> $S
echo "fp8 vs bf16 in $(( $(date +%s) - t0 )) s" >> $S
tar czf $OUT/call1.tar.gz -C $OUT serve sweep fp8 serve.out sweep.out fp8_tests.txt fp8.out 2>/dev/null
rm -rf $OUT/serve $OUT/sweep $OUT/fp8 $OUT/*.out
