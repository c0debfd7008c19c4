#!/usr/bin/env bash
# Session 53, right after call 4 on the same machine: `atlas bench serve` at concurrency 1 (16 requests, prompts of
# 128 random tokens, one front end), against the offline engine in the same run.
mkdir -p $OUT; export PYTHONPATH=$PWD
INPUT_LEN=128 RUNS="1:16:1" OUT=$OUT timeout 170 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1
grep -E "^serve_|requests ok|engine|offline" $OUT/serve.log | head -12; rm -f $OUT/pip.txt
