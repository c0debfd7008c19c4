#!/usr/bin/env bash
# Session 65 call 1 (written without a GPU: no machine was lent; for a later session; ~5 min): issue 34's three
# Qwen3-8B-shape rows with the row-tiles GEMV as the batch-1 default (25c1400), FP8 block against bf16 in one call,
# with torch.profiler summaries of the decode steps (PROFILE=1): at 2.77 ms a batch-1 FP8 step runs at 0.70 of its
# copy roofline against bf16's 0.85, and no profile has yet said which kernels (the GEMV by layer shape, the bf16 LM
# head, attention, norms) or host gaps hold the remaining 0.6 ms. Also the batch-256 step and the 2,048-token TTFT
# (1.15x and 0.79x, session 39) on today's tree, the 2,048-token prefill profiled too (what keeps FP8's TTFT at 0.79x
# against the 0.7x asked: the block-scaled cuBLASLt GEMMs, the activation quantizer, attention). BENCHMARKS.md 2.6.
mkdir -p $OUT
VARIANTS="bf16 block" BATCHES=1,256 PROFILE=1 timeout 560 bash tools/gpu_fp8.sh 2>&1 | grep -vE "^\s*$"
