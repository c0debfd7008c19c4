#!/usr/bin/env bash
# Session 66 call 2 (written without a GPU: no machine was lent; for a later session; ~8 min): the gemv_prefetch
# knob. The one-row GEMVs (bf16 "sum" tiles, FP8 row tiles) then load their first weight tile before the PDL wait,
# so that each projection's weights start streaming while the kernel before it (a norm, attention, the previous
# GEMV's tail) runs. A batch-1 step is ~250-300 kernels; the FP8 step stops at 0.70 of its copy roofline against
# bf16's 0.85 (BENCHMARKS.md 2.6), and an FP8 matrix is half the bytes of a bf16 one, so each kernel's ramp is a
# larger share of it. (1) The CUDA tests of the changed kernels (the GEMV and FP8 kernel cases, the FP8 models;
# the row-tiles kernel's code moved into load and sum helpers, 0c99819's wait moved before the pair's loads);
# (2) `atlas bench latency` at batch 1 (and 16 for the dense shapes: rows above 1 take other kernels, a check that
# nothing else moved) with the knob off and on, alternated twice: Qwen3-8B bf16, Qwen3-8B FP8 block, Qwen3-30B-A3B.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
cuda_tests kernels 200 3 tests/test_cuda.py tests/test_fp8_cuda.py -k "gemv or fp8 or row_tiles"
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe --config-only > /dev/null
bench() {  # NAME MODEL BATCHES PREFETCH
  timeout 75 python3 -m atlas.cli bench latency --model $2 --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size $3 --input-len 128 --output-len 64 \
    --num-iters 3 --num-iters-warmup 1 --tuning gemv_prefetch=$4 --output-json $OUT/$1_p$4.json > $OUT/$1_p$4.log 2>&1
  echo "$1 prefetch=$4: exit $?; $(grep -E 'atlas batch' $OUT/$1_p$4.log | tr '\n' ' ' | sed 's/[0-9-]* [0-9:,]* INFO atlas.bench.latency: //g')"
}
for pass in 1 2; do
  for p in 0 1; do
    bench q8_bf16_$pass /tmp/q8 1,16 $p
    bench q8_fp8_$pass /tmp/q8-fp8 1,16 $p
    bench q30_$pass /tmp/moe 1 $p
  done
done
tar -czf /tmp/c.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/c.tgz $OUT/call2.tgz
