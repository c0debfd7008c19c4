#!/usr/bin/env bash
# Session 76 call 5 (carry [".whl"]; ~5 min): issue 38's short rows (DFlash adaptive at 64 / 256 streams, 0.963 /
# 0.950x plain in session 58; n-gram adaptive at 64, 0.966x), whose plain engine's own passes differed by 5-15 %
# within one run: each speculative engine beside the plain engine (--interleave: pass i of each runs before pass
# i + 1 of either), 4 passes, the median of the paired ratios ("paired speed-up"). A fixed 14 GiB KV cache an
# engine, so two 8B engines fit one card; the rest as tools/gpu_spec_policy.sh.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
POLICIES=adaptive METHODS=dflash CONC=64,256 EXTRA="--interleave --repeats 4 --kv-cache-memory 14GiB" \
  timeout 300 bash tools/gpu_spec_policy.sh
mv $OUT/spec_adaptive.json $OUT/spec_dflash.json; mv $OUT/spec_logs.tar.gz $OUT/spec_dflash_logs.tar.gz
POLICIES=adaptive METHODS=ngram CONC=64 EXTRA="--interleave --repeats 4 --kv-cache-memory 14GiB" \
  timeout 200 bash tools/gpu_spec_policy.sh
mv $OUT/spec_adaptive.json $OUT/spec_ngram.json
echo "done at ${SECONDS}s"
