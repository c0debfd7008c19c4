#!/usr/bin/env bash
# Session 64 call 4 (not run yet: sessions 64 and 65 got no machine for it; carry [".whl", ".before"], ~6 min): `atlas bench serve` at 256 and 1 streams
# against the offline engine in the same run, after session 63's scheduler fixes (abc6e65, bd1f767, e81be2f: the
# engine loop's admission of n > 1 siblings and the priority policy's running order), this tree against the tree
# before them (b73551e), each `RUNS="256:1024:1 1:12:1" bash tools/gpu_serve.sh` (section 4's rows). Issue 37's last
# owed figure. `.before/` is made here, not on the device (the device copy has no git history):
#   rm -rf .before && mkdir .before && git archive b73551e atlas tools pyproject.toml | tar x -C .before \
#     && find .before -name "*.safetensors" -delete
mkdir -p $OUT/now $OUT/before /tmp/logs
cp -r .whl .before/ || echo "before tree: failed"
OUT=$OUT/now RUNS="256:1024:1 1:12:1" timeout 280 bash tools/gpu_serve.sh 2>&1 | grep -E "exit|tok/s|ratio|TTFT"
(cd .before && OUT=$OUT/before RUNS="256:1024:1 1:12:1" timeout 280 bash tools/gpu_serve.sh 2>&1 \
  | grep -E "exit|tok/s|ratio|TTFT")
