#!/usr/bin/env bash
# Session 73 call 3 (carry [".whl"]): call 2's three failures again, now that the CUDA tests compare with Atlas's CPU
# path where the GPU machine's transformers (5.17) predates its fix for the family (conftest.REFERENCE_FIXED_IN:
# MiniMax-M2's rotary_dim, 5.18; Bamba's and Granite 4.0-H's per-group gated norm, 5.23); the fused-ops CUDA file,
# cut at 50 s in call 2, with room.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import transformers; print('transformers', transformers.__version__)"
cuda_tests fixed 150 3 tests/test_ssm_hybrids.py tests/test_moe_families.py \
  -k "(on_cuda and (bamba or moe)) or (single_row and minimax)"
cuda_tests fusedops 190 4 tests/test_fused_ops.py
