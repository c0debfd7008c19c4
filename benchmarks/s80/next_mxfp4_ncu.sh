#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~4 min; an H100 or H200 on Firecracker, where ncu reads counters).
# Issue 41: why the MXFP4 row tiles run at 0.3-0.45 of the copy rate, and why configurations that issue fewer
# instructions a weight (the e4m3 decode, 16 runs) are not faster in gpt-oss-20b's step (benchmarks/s80/README.md).
# 1. Nsight Compute on the kernels alone (benchmarks/s80/mxfp4_ncu_calls.py), three configurations: the default,
#    e4m3 at 16 runs, down at 64 runs with two stages; the first two calls' kernels (compilation) skipped, four
#    profiled: duration, DRAM throughput, achieved occupancy, the warp stall reasons, issue slots.
# 2. The step in the model, profiled with PDL on (as it runs) for the default and e4m3 at 16 runs: each kernel's time
#    in place (`atlas bench latency --profile`).
mkdir -p $OUT /tmp/p
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
# (the warp stall reasons, per issued instruction)
STALLS=$(for r in long_scoreboard short_scoreboard wait math_pipe_throttle lg_throttle mio_throttle barrier \
  not_selected selected no_instruction dispatch_stall branch_resolving drain membar; do
  printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $r; done | sed 's/,$//')
i=0
for steps in "" "gate_up:16:1:e4m3;down:16:1:e4m3" "gate_up:0:1:bits;down:64:2:bits"; do
  i=$((i + 1))
  timeout 100 $NCU --clock-control none --kernel-name regex:_mxfp4_.*row_tiles --launch-skip 4 --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section LaunchStats --metrics "$STALLS" --csv --page details \
    python3 benchmarks/s80/mxfp4_ncu_calls.py --steps "$steps" --calls 6 > /tmp/p/ncu_$i.csv 2> /tmp/p/ncu_$i.err
  echo "ncu [$steps]: exit $?; $(wc -l < /tmp/p/ncu_$i.csv) lines"; tail -2 /tmp/p/ncu_$i.err | cut -c1-200
  grep -E '"(Duration|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|Registers Per Thread|smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active.ratio|Warp Cycles Per Issued Instruction)"' \
    /tmp/p/ncu_$i.csv | awk -F'","' '{print $5, "|", $(NF-2), $(NF-1), $NF}' | sort | uniq | cut -c1-160 | head -60
done
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
for cfg in default e4m3_16; do
  steps=""; [ $cfg = e4m3_16 ] && steps="gate_up:16:1:e4m3;down:16:1:e4m3"
  timeout 150 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 3 ${steps:+--tuning "moe_mxfp4_row_steps=$steps"} --profile /tmp/p/prof_$cfg \
    --output-json /tmp/p/lat_$cfg.json > /tmp/p/lat_$cfg.log 2>&1
  echo "latency $cfg: exit $?"; head -n 24 /tmp/p/prof_$cfg/latency_*_summary.txt 2>/dev/null | cut -c1-170
done
find /tmp/p -name "*.json*" -size +15M -delete
tar czf $OUT/ncu.tgz -C /tmp p
echo "done at ${SECONDS}s"
