#!/usr/bin/env bash
# Device call 3 (session 46): the CUDA test files whose tests refused to plan their KV pool beside call 1's other
# workers, run alone; then batch-256 latency before and after the snapshot merge again (5 iterations each,
# before first) on call 2's checkpoint when the machine still holds it.
mkdir -p $OUT
ls /root/out 2>/dev/null | head -3
for f in /root/out/latency_before_2.txt /root/out/spec_cost_*_2.txt; do [ -f $f ] && { echo "== $f"; cat $f; }; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout -k 10 330 python3 -m pytest -q -m cuda tests/test_dsa_mtp.py tests/test_gpt_oss_cuda.py tests/test_hybrid_cuda.py \
  tests/test_kv_cache_dtype.py -p no:cacheprovider -rfE --durations=10 --junitxml=$OUT/cuda_alone.xml > $OUT/cuda_alone.log 2>&1
echo "tests exit $?" | tee -a $OUT/cuda_alone.log; tail -n 25 $OUT/cuda_alone.log
CK=/tmp/ck8b
if [ -f $CK/config.json ]; then
  for tree in before after; do
    root=$PWD; [ $tree = before ] && root=$PWD/.before
    (cd $root && PYTHONPATH=/tmp/site:$root timeout 100 python3 -m atlas.cli bench latency --model $CK --skip-tokenizer-init \
      --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 256 --input-len 128 --output-len 256 --num-iters 5 \
      --num-iters-warmup 1 --peer none --output-json $OUT/latency256_$tree.json > $OUT/latency256_$tree.log 2>&1)
    grep -E "iteration|ms/step" $OUT/latency256_$tree.log
  done
fi
