#!/usr/bin/env bash
# Session 58. Call 1 (the policy table on c1be23b) measured n-gram and random-drafter DFlash under the adaptive policy at
# 0.92-0.96x plain at 16-256 requests, below session 47 / 57's 0.95-0.99x, from one timed pass a row. Here, after the
# engine repeats a "plain" decision for an unchanged batch instead of reading every request each step (the policy's
# decide_same_batch: about 0.3 ms a step less host work at 256 requests) and gathers no commits for a proposer
# that reads none (n-gram), the same rows with 3 timed passes each (the
# per-pass figures say whether a row's loss is steady or one-off), then the policy's CUDA test.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
POLICIES=adaptive METHODS=ngram,dflash CONC=1,16,64,256 EXTRA="--repeats 3" timeout 420 bash tools/gpu_spec_policy.sh
source tools/device_site.sh
cuda_tests policy 150 1 tests/test_speculation_policy.py
