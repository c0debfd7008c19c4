#!/usr/bin/env bash
# What is owed on a GPU, in order, for the next session (carry [".whl"]; add ".s31" for PART=s31, built as
# benchmarks/s66/call5.sh's header says). Each PART is one call; chain them on one warm machine.
#   tests (~4 min, any card): the rest of tests/test_cuda.py (session 92's call was cut after 47 of 60 passed: the
#         fused-combine knob's float32 case, the CUDA-graph replays with and without it, the GEMV tests after).
#   spec (~8 min, an H200): issue 38's rows at 1/16/64/256 streams (PART=spec of benchmarks/s91/next.sh).
#   steps | ttft | moe-fp8 (an H200): issue 34's and 41's rows (benchmarks/s91/next.sh's header).
#   s31 (~7 min, an H200): issue 38's bar on the shipped model, session 31's tree against this one in one call.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
case ${PART:-tests} in
  tests) source tools/device_site.sh; mkdir -p $OUT
         cuda_tests cuda_rest 330 1 tests/test_cuda.py \
           -k "merged_by_its_last_split or inside_a_cuda_graph or gemv or token_mask" ;;
  spec|steps|ttft|moe-fp8) bash benchmarks/s91/next.sh ;;
  s31) bash benchmarks/s66/call5.sh ;;
esac
echo "done at ${SECONDS}s"
