#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~10 min; supersedes s71/next.sh's tests, whose items are here):
# the CUDA tests owed on the tree after session 72. (1) Session 71's: the paged-attention kernel's chunk mask and
# soft-capping (the core CUDA file, Llama 4, Gemma 2, Cohere, GLM-4.7-Flash), the sparse-MoE families, the one-set
# LoRA engine, FP8 fused quantization on an MLA. (2) Session 72's: the Mamba-2 hybrids (Granite 4.0-H, Nemotron-H:
# the scan kernel and the biased convolution against the reference in fp32 and bf16, then greedy tokens through the
# CUDA graphs, plain and under n-gram, against transformers; LFM2's short convolution and Jamba's Mamba scan
# likewise), the Gated DeltaNet hybrids (their convolution kernels
# took the bias's constexpr branch), the routing kernel's floor (ERNIE's moe_norm_min) in the DeepSeek / MoE
# kernel cases, and the activation kernels' new ReLU code (Nemotron 3 Nano's experts; the fused-ops cases run every
# activation, the MoE cases the fused expert pairs with it). The H200's batch-1 FP8 row of issue 34 is s71/next.sh's second half (`b1`), unchanged.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests core 200 4 tests/test_cuda.py tests/test_llama4.py tests/test_gemma2.py tests/test_cohere.py tests/test_glm_lite.py
cuda_tests hybrids 150 3 tests/test_ssm_hybrids.py tests/test_hybrid_cuda.py
cuda_tests moe 120 2 tests/test_moe_families.py tests/test_deepseek_cuda.py -k "moe or routing or kernel or family"
cuda_tests fusedops 60 2 tests/test_fused_ops.py
cuda_tests lora 90 2 tests/test_lora_cuda.py tests/test_mixed_graphs.py
cuda_tests fused 60 2 tests/test_fp8_cuda.py -k fused_activation
