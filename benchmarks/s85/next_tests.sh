#!/usr/bin/env bash
# For the next session with a GPU, first (carry [".whl"]; ~6 min): the CUDA tests owed by session 85's last changes,
# which no GPU ran: the grouped expert kernel adding the expert biases in its epilogue (4bc7867, 45105e0; its launch
# gained two arguments for every model that takes it) and the clamped activations in _act_and_mul_kernel (the
# activation kernel of every dense MLP too: two more arguments, gated_pair's forms). The fused elementwise kernels
# against their references and in CUDA graphs, the MXFP4 kernels at gpt-oss-20b's shape, the gpt-oss model eager and
# in CUDA graphs, the FP8 MoE and MoE-family files, and the DeepSeek-V4 model's CUDA cases where present.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cuda_tests fused_ops 120 2 tests/test_fused_ops.py
cuda_tests mxfp4 80 1 tests/test_moe_mxfp4.py
cuda_tests gpt_oss 80 2 tests/test_gpt_oss_cuda.py
cuda_tests moe 110 2 tests/test_moe_fp8.py tests/test_moe_families.py
cuda_tests dense 100 2 tests/test_cuda.py -k "no_kernel_compiles or graph"
echo "done at ${SECONDS}s"
