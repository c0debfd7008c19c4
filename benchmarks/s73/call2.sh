#!/usr/bin/env bash
# Session 73 call 2 (carry [".whl"]): call 1's owed tests again with room: the state-space hybrids' CUDA tests (cut
# at 170 s in call 1 with two failures whose names the cut lost) on more workers; the MiniMax-M2 router test's
# divergence probed (minimax_probe.py: where transformers on CUDA leaves Atlas's and transformers' CPU tokens); the
# ERNIE router test with its config key fixed; the rest of s72/next.sh (fused ops, LoRA, FP8 fused activation).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests hybrids 260 6 tests/test_ssm_hybrids.py tests/test_hybrid_cuda.py
mkdir -p /tmp/mp && timeout 60 python3 benchmarks/s73/minimax_probe.py /tmp/mp > $OUT/minimax_probe.txt 2>&1
grep -v "Loading\|Writing" $OUT/minimax_probe.txt | head -8
cuda_tests ernie 50 1 tests/test_moe_families.py -k "single_row and ernie"
cuda_tests fusedops 50 2 tests/test_fused_ops.py
cuda_tests lora 80 2 tests/test_lora_cuda.py tests/test_mixed_graphs.py
cuda_tests fused 50 2 tests/test_fp8_cuda.py -k fused_activation
