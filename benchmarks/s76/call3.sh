#!/usr/bin/env bash
# Session 76 call 3 (carry [".whl", ".before"]; ~6 min): issue 37's serve figure after the server changes since
# session 69 (d0bf628, its last serve run): `atlas bench serve` at 256 and 1 streams against the offline engine in
# the same run, this tree and d0bf628 (.before/, made here:
#   rm -rf .before && mkdir .before && git archive d0bf628 atlas tools pyproject.toml | tar x -C .before \
#     && find .before -name "*.safetensors" -delete), each `RUNS="256:1024:1 1:12:1" bash tools/gpu_serve.sh`.
mkdir -p $OUT/now $OUT/before /tmp/logs
cp -r .whl .before/ || echo "before tree: failed"
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT/now RUNS="256:1024:1 1:12:1" timeout 280 bash tools/gpu_serve.sh 2>&1 | grep -E "exit|tok/s|ratio|TTFT"
(cd .before && OUT=$OUT/before RUNS="256:1024:1 1:12:1" timeout 280 bash tools/gpu_serve.sh 2>&1 \
  | grep -E "exit|tok/s|ratio|TTFT")
echo "done at ${SECONDS}s"
