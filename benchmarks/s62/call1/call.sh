#!/usr/bin/env bash
# Session 62 call 1 (written without a GPU: run it in a later session; carry [".whl"]). What session 62 changed in
# the FP8 kernels, measured:
# 1. the FP8 CUDA tests: every kernel against its reference at the 8B shapes, the row-tiles GEMV ("rt") among them,
#    and tiny FP8 models greedy under graphs = eager with the rt configs; the FP8 experts at DeepSeek-V3's shapes
#    (moe_fp8_cases.py v3: the down rows kernel now sums float32 weights);
# 2. batch-1 decode of the Qwen3-8B shape, FP8 block against bf16, through each one-row config
#    (tools/gpu_fp8_model_sweep.sh: the shipped sum-n4k2048w4s3 against the rt tiles);
# 3. the Qwen3-30B-A3B shape in FP8 (block) at batch 1 and 64: this tree, the same with the experts' gate|up through
#    the row tiles (--tuning moe_fp8_row_tiles=1), and the down kernel's rounding put back
#    (benchmarks/s62/moe_down_f32.patch reversed), alternated twice.
# Figures go to BENCHMARKS.md 2.6 and 7.2; if an rt config wins, it becomes GEMV_CONFIGS[1] and the FP8 CUDA tests
# run again.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests fp8 220 4 tests/test_fp8_cuda.py
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider -rfE tests/test_moe_fp8.py > $OUT/tests_moe_fp8.log 2>&1
echo "moe fp8 tests exit $?; $(tail -n 1 $OUT/tests_moe_fp8.log)"
OUT=$OUT CONFIGS="sum-n4k2048w4s3 rt-n4k2048w4s1 rt-n4k2048w4s2 rt-n4k2048w4s3 rt-n4k4096w8s1 rt-n2k2048w4s1 \
rt-n4k1024w4s1 rt-n2k4096w4s1 rt-n1k2048w4s1" timeout 200 bash tools/gpu_fp8_model_sweep.sh > $OUT/sweep.out 2>&1
cat $OUT/fp8_sweep.txt
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe-fp8 --config-only --fp8 block > /dev/null
rm -rf /tmp/before && mkdir /tmp/before && git archive HEAD | tar x -C /tmp/before \
  && (cd /tmp/before && git apply -R $OLDPWD/benchmarks/s62/moe_down_f32.patch) || echo "before tree: failed"
for pass in 1 2; do
  for tree in now rt before; do
    dir=$PWD; [ $tree = before ] && dir=/tmp/before
    knob=""; [ $tree = rt ] && knob="--tuning moe_fp8_row_tiles=1"
    (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 100 python3 -m atlas.cli bench latency --model /tmp/moe-fp8 \
      --load-format dummy --skip-tokenizer-init --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 \
      --batch-size 1,64 --input-len 128 --output-len 64 --num-iters 3 --output-json $OUT/moe_fp8_${tree}_$pass.json \
      $knob > $OUT/moe_fp8_${tree}_$pass.log 2>&1)
    echo "moe fp8 $tree pass $pass: exit $?; $(python3 -c "import json,sys; print(' '.join(f\"b{r['batch_size']} \
{r['ms_per_step']:.3f} ms ({r['decode_roofline_fraction']:.3f})\" for r in json.load(open(sys.argv[1]))['rows']))" \
      $OUT/moe_fp8_${tree}_$pass.json 2>/dev/null)"
  done
done
