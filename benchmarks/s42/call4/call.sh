#!/usr/bin/env bash
# Device call 4 (session 42): the CUDA test files of the hybrid models and the fused ops on the final sources.
FILES="hybrid_cuda:80 fused_ops:70" LIMIT=185 W=/tmp/call4 bash benchmarks/s42/call3/call.sh
