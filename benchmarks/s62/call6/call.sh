#!/usr/bin/env bash
# Session 62 call 6 (for a later session with a GPU; carry [".whl"]; ~8 min): issue 38's DFlash step (1.40x a plain
# step against 1.2x) is mostly its verify step, 1.22-1.27x alone: a verify step's 8 or 16 rows go through cuBLAS,
# "below the bandwidth of one" row through the GEMV. The tl.dot GEMV tiles are not issue-bound at 16 rows on sm_90
# (tools/sass_loop_mix.py's counts: 0.04-0.10 warp instructions a weight, 4-12x under bf16's limit), so the question
# is only measured speed: `atlas bench gemv` on the Qwen3-8B shapes at 8 and 16 rows (every tile of its grid against
# cuBLAS, each in a CUDA graph over copies past the L2). A tile that beats cuBLAS there would take the verify rows
# (kernels/gemv.py: the gemv_rows knob, then its default); then `atlas bench spec-cost` with two such tiles.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
timeout 400 python3 -m atlas.cli bench gemv --model /tmp/q8 --rows 8,16 --top 6 --output-json $OUT/gemv_rows.json \
  > $OUT/gemv_rows.log 2>&1
echo "bench gemv: exit $?"; tail -n 70 $OUT/gemv_rows.log | cut -c1-160
# The DFlash step itself with a verify step's rows through two dot tiles (the gemv_rows knob) against cuBLAS.
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only --dflash-drafter > /dev/null
for rows in "" "8:dot-n16k256w4s4;16:dot-n16k256w4s4" "8:dot-n32k256w4s4;16:dot-n32k256w4s4"; do
  name=${rows:+dot$(echo "$rows" | cut -d- -f2 | cut -dk -f1)}; name=${name:-cublas}
  timeout 120 python3 -m atlas.cli bench spec-cost --model /tmp/q8 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --draft-model /tmp/q8/dflash-drafter --draft-lengths 7,15 \
    --batch-size 1 --input-len 128 --output-len 64 ${rows:+--tuning "gemv_rows=$rows"} \
    --output-json $OUT/spec_cost_$name.json > $OUT/spec_cost_$name.log 2>&1
  echo "spec-cost $name: exit $?"; tail -n 8 $OUT/spec_cost_$name.log | cut -c1-160
done
