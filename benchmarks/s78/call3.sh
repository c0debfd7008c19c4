#!/usr/bin/env bash
# Session 78 call 3 (carry [".whl"]; ~6 min): issue 41's gpt-oss-20b shape (MXFP4 experts; 0.262 of its batch-1
# roofline on the H200 in session 60): session 62's call 5, never run until now (the MXFP4 CUDA tests, the batch-1
# step with the experts in row tiles, --tuning moe_row_tiles=1, and without, alternated twice, and the MXFP4 kernels
# alone), then where that step goes, kernel by kernel: `atlas bench latency --profile` with PDL off (each kernel's own
# time) and on, row tiles on.
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
bash benchmarks/s62/call5/call.sh
prof() {  # NAME TUNING
  timeout 120 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 2 --num-iters-warmup 1 --tuning "$2" --profile /tmp/p/prof_$1 --output-json /tmp/p/lat_$1.json \
    > /tmp/p/lat_$1.log 2>&1
  echo "$1: exit $?; $(grep -E 'atlas batch' /tmp/p/lat_$1.log | tail -n 1 | cut -c1-200)"
}
prof oss_rt_nopdl moe_row_tiles=1,pdl=0
prof oss_rt moe_row_tiles=1
find /tmp/p -name "*.json*" -size +15M -delete
for f in /tmp/p/prof_*/latency_*_summary.txt; do echo "== $f"; head -n 40 $f | cut -c1-170; done > $OUT/summaries.txt
tar czf $OUT/prof.tgz -C /tmp p
echo "call done at ${SECONDS}s"
# the tensor-core MXFP4 GEMV probe against the shipped one-token expert kernels (benchmarks/s78/mxfp4_dot_probe.py)
timeout 200 python3 benchmarks/s78/mxfp4_dot_probe.py --out $OUT/mxfp4_dot_probe.json > $OUT/mxfp4_dot_probe.log 2>&1
echo "probe: exit $?"; grep -v '"error"' $OUT/mxfp4_dot_probe.log | cut -c1-260 | tail -40
echo "call done at ${SECONDS}s"
