#!/usr/bin/env bash
# Session 62 call 3 (for a later session with a GPU; carry [".whl"]; ~6 min): the Qwen3-30B-A3B shape with block-FP8
# experts at batch 1 (the one-token kernels changed; 64 tokens take the grouped kernel) (`atlas bench latency --load-format dummy`): this tree, the same with the experts' gate|up
# through the row tiles (--tuning moe_row_tiles=1), and the down rows kernel's rounding of each weight to bf16 put
# back (benchmarks/s62/moe_down_f32.patch reversed), alternated twice; then the expert kernels alone at one token
# (tools/moe_decode_kernel_bench.py: FP8, K tiles 256-2048, 3 and 2 stages, the gate|up row tiles). Figures go to
# BENCHMARKS.md 7.2; bf16's: call 4.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe-fp8 --config-only --fp8 block > /dev/null
rm -rf /tmp/before && mkdir /tmp/before && git archive HEAD | tar x -C /tmp/before \
  && (cd /tmp/before && git apply -R $OLDPWD/benchmarks/s62/moe_down_f32.patch) || echo "before tree: failed"
for pass in 1 2; do
  for tree in now rt before; do
    dir=$PWD; [ $tree = before ] && dir=/tmp/before
    knob=""; [ $tree = rt ] && knob="--tuning moe_row_tiles=1"
    (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 100 python3 -m atlas.cli bench latency --model /tmp/moe-fp8 \
      --load-format dummy --skip-tokenizer-init --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 \
      --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --output-json $OUT/moe_fp8_${tree}_$pass.json \
      $knob > $OUT/moe_fp8_${tree}_$pass.log 2>&1)
    echo "moe fp8 $tree pass $pass: exit $?; $(python3 -c "import json,sys; print(' '.join(f\"b{r['batch_size']} \
{r['ms_per_step']:.3f} ms ({r['decode_roofline_fraction']:.3f})\" for r in json.load(open(sys.argv[1]))['rows']))" \
      $OUT/moe_fp8_${tree}_$pass.json 2>/dev/null)"
  done
done
timeout 150 python3 tools/moe_decode_kernel_bench.py --shape qwen3-30b-a3b --formats fp8 \
  --block-k 256,512,1024,2048 --warps 4 --stages 3,2 --out $OUT/moe_kernels.json > $OUT/moe_kernels.log 2>&1
echo "moe kernels: exit $?"; python3 -c "import json,sys; [print({k: (round(v, 3) if isinstance(v, float) else v) \
for k, v in r.items() if k.endswith(('us', 'roofline')) or k in ('format', 'block_k', 'num_stages', \
'gate_up_row_tiles')}) for r in json.load(open(sys.argv[1]))['results']]" $OUT/moe_kernels.json 2>/dev/null
