#!/usr/bin/env bash
# Session 62 call 4 (for a later session with a GPU; carry [".whl"]; ~5 min): the bf16 Qwen3-30B-A3B shape's batch-1
# step (issue 41: 0.488 of its roofline against 0.6), two questions from the kernels' sm_90 resources
# (tools/sass_loop_mix.py, BENCHMARKS.md 7.2): (1) the one-row GEMV's 3 stages take 40 KiB of shared memory a program,
# 5 programs an SM, and the attention projections' K = 2048 is one tile (nothing to pipeline): `--tuning gemv=auto`
# times each shape's configs at load (1 stage among them) against the default, alternated twice; (2) the expert
# kernels alone at 3, 2 and 1 stages and K tiles 256-2048 (the down rows kernel's 64 KiB at 3 stages fits 3 programs
# an SM: 1.3 waves of its 512 at one token). Figures go to BENCHMARKS.md 7.1.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe --config-only > /dev/null
for pass in 1 2; do
  for gemv in default auto; do
    timeout 100 python3 -m atlas.cli bench latency --model /tmp/moe --load-format dummy --skip-tokenizer-init \
      --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
      --num-iters 3 --tuning gemv=$gemv --output-json $OUT/moe_gemv_${gemv}_$pass.json > $OUT/moe_gemv_${gemv}_$pass.log 2>&1
    echo "gemv=$gemv pass $pass: exit $?; $(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; \
print(f\"{r['ms_per_step']:.3f} ms ({r['decode_roofline_fraction']:.3f})\")" $OUT/moe_gemv_${gemv}_$pass.json 2>/dev/null)"
  done
done
grep -h "small-M GEMV" $OUT/moe_gemv_auto_1.log | cut -c1-1500
timeout 150 python3 tools/moe_decode_kernel_bench.py --shape qwen3-30b-a3b --formats bf16 \
  --block-k 256,512,1024,2048 --warps 4 --stages 3,2,1 --out $OUT/moe_kernels_bf16.json > $OUT/moe_kernels_bf16.log 2>&1
echo "moe kernels: exit $?"; python3 -c "import json,sys; [print({k: (round(v, 3) if isinstance(v, float) else v) \
for k, v in r.items() if k.endswith(('us', 'roofline')) or k in ('block_k', 'num_stages')}) \
for r in json.load(open(sys.argv[1]))['results']]" $OUT/moe_kernels_bf16.json 2>/dev/null
