#!/usr/bin/env bash
# Session 68 call 1 (carry [".whl", ".before"]; <= 10 min: machines were scarce, so the two owed runs share one
# call): (1) the CUDA tests after session 67's layer, model, sampler and runner changes, the files that run those
# paths (LoRA slots in the step and mixed graphs against PEFT, the core graph / kernel file, the FP8 models under
# graphs, mixed graphs), 4 pytest-xdist workers, cut at 250 s; (2) issue 37's owed figure, `atlas bench serve` at
# 256 streams against the offline engine in the same run, this tree and the tree before session 63's scheduler
# fixes (b73551e, .before/), each `RUNS="256:1024:1" bash tools/gpu_serve.sh` cut at 160 s (s64/call4.sh is the
# fuller run, with the 1-stream row).
mkdir -p $OUT/now $OUT/before /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests core 250 4 tests/test_lora_cuda.py tests/test_cuda.py tests/test_mixed_graphs.py tests/test_fp8_cuda.py
cp -r .whl .before/ || echo "before tree: failed"
OUT=$OUT/now RUNS="256:1024:1" timeout 160 bash tools/gpu_serve.sh 2>&1 | grep -E "exit|tok/s|ratio|TTFT"
(cd .before && OUT=$OUT/before RUNS="256:1024:1" timeout 160 bash tools/gpu_serve.sh 2>&1 \
  | grep -E "exit|tok/s|ratio|TTFT")
