#!/usr/bin/env bash
# Device call 2 (session 43): the DeepSeek, gpt-oss, DFlash, speculation-policy, hybrid and fused-op CUDA files on
# the same sources as call 1 (session 42's call 3 script with other files).
FILES="deepseek_cuda:100 hybrid_cuda:40 fused_ops:45 gpt_oss_cuda:42 dflash:22 speculation_policy:15" LIMIT=575 \
  W=/tmp/call2 bash benchmarks/s42/call3/call.sh
