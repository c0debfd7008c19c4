#!/usr/bin/env bash
# Session 64 call 4 (not run: for a later session; carry [".whl"], ~6 min): `atlas bench serve` at 256 and 1 streams
# against the offline engine in the same run, after session 63's scheduler fixes (abc6e65, bd1f767, e81be2f: the
# engine loop's admission of n > 1 siblings and the priority policy's running order), this tree against the tree
# before them (b73551e), each `RUNS="256:1024:1 1:12:1" bash tools/gpu_serve.sh` (section 4's rows). Issue 37's last
# owed figure.
mkdir -p $OUT/now $OUT/before /tmp/logs
rm -rf /tmp/before && mkdir /tmp/before && git archive b73551e | tar x -C /tmp/before && cp -r .whl /tmp/before/ \
  || echo "before tree: failed"
OUT=$OUT/now RUNS="256:1024:1 1:12:1" timeout 280 bash tools/gpu_serve.sh 2>&1 | grep -E "exit|tok/s|ratio|TTFT"
(cd /tmp/before && OUT=$OUT/before RUNS="256:1024:1 1:12:1" timeout 280 bash tools/gpu_serve.sh 2>&1 \
  | grep -E "exit|tok/s|ratio|TTFT")
