#!/usr/bin/env bash
# Session 62 call 5 (for a later session with a GPU; carry [".whl"]; ~4 min): the gpt-oss-20b shape (MXFP4 experts;
# issue 41: 0.262 of its batch-1 roofline against 0.6): the batch-1 step with the experts' gate|up in row tiles
# (--tuning moe_row_tiles=1: 0.250 warp instructions a weight on sm_90 against the pairs kernel's 0.578) and without,
# alternated twice; then the MXFP4 kernels alone (tools/moe_decode_kernel_bench.py, each against the dequantized
# weights' bf16 kernels). The MXFP4 CUDA tests (tests/test_moe_mxfp4.py, test_gpt_oss_cuda.py) run the row tiles
# through moe_mxfp4_cases.py. Figures go to BENCHMARKS.md 7.3.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider -rfE tests/test_moe_mxfp4.py > $OUT/tests_mxfp4.log 2>&1
echo "mxfp4 tests exit $?; $(tail -n 1 $OUT/tests_mxfp4.log)"
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
for pass in 1 2; do
  for knob in 0 1; do
    timeout 100 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
      --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
      --num-iters 3 --tuning moe_row_tiles=$knob --output-json $OUT/oss_rt${knob}_$pass.json > $OUT/oss_rt${knob}_$pass.log 2>&1
    echo "gpt-oss moe_row_tiles=$knob pass $pass: exit $?; $(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; \
print(f\"{r['ms_per_step']:.3f} ms ({r['decode_roofline_fraction']:.3f})\")" $OUT/oss_rt${knob}_$pass.json 2>/dev/null)"
  done
done
timeout 100 python3 tools/moe_decode_kernel_bench.py --shape gpt-oss-20b --formats mxfp4 --block-k 1024 --warps 4 \
  --out $OUT/oss_kernels.json > $OUT/oss_kernels.log 2>&1
echo "gpt-oss kernels: exit $?"; grep -h '"format"' $OUT/oss_kernels.log | cut -c1-400
