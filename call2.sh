#!/usr/bin/env bash
# session 39 call 2: atlas bench serve on the final sources: 256 streams with 1, 2 (text in the front ends, and
# in the engine for the A/B), 4 front ends; 64 streams with 2; 1 stream with 2
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$OUT/summary.txt
echo "sources $(git rev-parse HEAD 2>/dev/null) $(date -u +%FT%TZ)" >> $S
t0=$(date +%s)
RUNS="256:1024:2 256:1024:1 256:1024:4 64:512:2 1:32:2" OUT=$OUT/serve bash tools/gpu_serve.sh > $OUT/serve.out 2>&1
echo "serve in $(( $(date +%s) - t0 )) s" >> $S; t0=$(date +%s)
RUNS="256:1024:2" EXTRA="--detokenize-in engine" OUT=$OUT/serve_engine_text bash tools/gpu_serve.sh > $OUT/serve_engine_text.out 2>&1
echo "serve (text in the engine) in $(( $(date +%s) - t0 )) s" >> $S
for f in $OUT/serve.out $OUT/serve_engine_text.out; do grep -v "INFO\|machine:" $f | grep -A9 "^serve_" >> $S; done
tar czf $OUT/call2.tar.gz -C $OUT serve serve_engine_text serve.out serve_engine_text.out 2>/dev/null
rm -rf $OUT/serve $OUT/serve_engine_text $OUT/*.out
