#!/usr/bin/env bash
# Session 68 call 3 (carry [".whl"]; ~5 min: for a budget too small for call 1): the CUDA tests alone, the files
# that run session 67's changed paths (LoRA slots in the step and mixed graphs against PEFT, the core graph / kernel
# file, the FP8 models under graphs, mixed graphs), 4 pytest-xdist workers, cut at 240 s.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests core 240 4 tests/test_lora_cuda.py tests/test_cuda.py tests/test_mixed_graphs.py tests/test_fp8_cuda.py
