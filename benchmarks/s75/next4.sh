#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~8 min): tests/test_cuda.py whole, after the Llama base class's
# neox_rope switch (every Llama-family model's decoder reads it) and the dense families added after the calls
# (Arcee AFM, the first GLM-4, Helium: two per-architecture tests each).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests core 500 4 tests/test_cuda.py
echo "done at ${SECONDS}s"
