#!/usr/bin/env bash
# Session 76 call 1 (carry [".whl"]; ~6 min): tests/test_cuda.py whole after session 75's Llama base-class neox_rope
# switch and dense families (Arcee AFM, the first GLM-4, Helium), and Solar Open's single-row router test
# (benchmarks/s75/next4.sh and the second half of next1.sh), one pytest session, 4 workers, slowest tests listed.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests core 520 4 --durations=12 tests/test_cuda.py \
  "tests/test_moe_families.py::test_single_row_routers_run_the_gemv_on_cuda_and_give_transformers_tokens[solar_open]"
echo "done at ${SECONDS}s"
