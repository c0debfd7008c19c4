#!/usr/bin/env bash
# Prepared in session 50: issue 42's DSA figures, now that the DSA Triton kernels passed their CUDA tests (session 50,
# call 1). The DeepSeek-V3.2 shape cut to one GPU, batch-1 decode at 2k, 16k and 64k context with DSA against the
# same model as dense MLA, TTFT of the 16k prompt, profiles of the decode steps (the indexer's share):
# tools/gpu_dsa.sh. (DSA steps run eagerly: the indexer's scores are sized by the step's longest context, a host
# number, so its CUDA graphs are not captured yet; the dense twin replays graphs.)
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=$OUT timeout 560 bash tools/gpu_dsa.sh > $OUT/gpu_dsa.log 2>&1
echo "exit $?" >> $OUT/gpu_dsa.log
grep -E "^== |atlas batch 1:|exit" $OUT/gpu_dsa.log
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
