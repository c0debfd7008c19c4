#!/usr/bin/env bash
# Session 64 call 2 (not run: the device time ran out; carry [".whl"], ~4 min): the FP8 CUDA tests with the row-tiles
# GEMV the batch-1 default (GEMV_CONFIGS[1] = rt-n4k2048w4s1, after call 1's sweep), the model tests on the fixed KV
# cache: s62/call1's run (every FP8 kernel at the 8B shapes, the tiny FP8 models of every layout under graphs
# against eager, whose one-row steps now take the row tiles, and the FP8 experts at DeepSeek-V3's shapes) again.
exec bash "$(dirname "$0")/../s62/call1/call.sh"
