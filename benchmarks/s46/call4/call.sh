#!/usr/bin/env bash
# Device call 4 (session 46): batch-256 decode before and after the snapshot merge, alternated before, after,
# before, after (5 iterations each; call 2 saw 11.05 after against 10.63 ms/step before in one pair). Run twice: as
# merged (4.4 % slower: more collections of the garbage collector), then with the shared idle records (call 5).
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
CK=/tmp/ck8b
PYTHONPATH=/tmp/site:$PWD python3 tools/make_random_checkpoint.py --shape qwen3-8b --out $CK > $OUT/checkpoint.log 2>&1 || exit 1
for round in 1 2; do
  for tree in before after; do
    root=$PWD; [ $tree = before ] && root=$PWD/.before
    (cd $root && PYTHONPATH=/tmp/site:$root timeout 100 python3 -m atlas.cli bench latency --model $CK --skip-tokenizer-init \
      --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 256 --input-len 128 --output-len 256 --num-iters 5 \
      --num-iters-warmup 1 --peer none > $OUT/latency256_${tree}_$round.log 2>&1)
    echo "== $tree $round"; grep -E "iteration|ms/step" $OUT/latency256_${tree}_$round.log | sed 's/.*INFO atlas.bench.latency: //'
  done
done
