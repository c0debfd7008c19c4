#!/usr/bin/env bash
# Device call 2 (session 46): issue 37's before/after in one run. `atlas bench latency` (batch 1 and 256, 128 in /
# 256 out, no peer) and `atlas bench spec-cost` (DFlash, draft lengths 7 and 15) on a random Qwen3-8B-shaped
# checkpoint, with main after the snapshot merge ("after", this tree) and main just before it ("before": the
# package as of 5a2a951, carried in .before/), alternated after, before, after, before.
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
CK=/tmp/ck8b
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out $CK --dflash-drafter > $OUT/checkpoint.log 2>&1 || exit 1
COMMON=(--model $CK --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096)
for round in 1 2; do
  for tree in after before; do
    root=$PWD; [ $tree = before ] && root=$PWD/.before
    export PYTHONPATH=/tmp/site:$root
    cd $root  # (python3 -m puts the working folder first on the path)
    python3 -c "import atlas; print('$tree', atlas.__file__)"
    timeout 150 python3 -m atlas.cli bench latency "${COMMON[@]}" --batch-size 1,256 --input-len 128 --output-len 256 \
      --num-iters 3 --num-iters-warmup 1 --peer none --output-json $OUT/latency_${tree}_$round.json \
      > $OUT/latency_${tree}_$round.log 2>&1; echo "latency $tree $round exit $?"
    timeout 100 python3 -m atlas.cli bench spec-cost "${COMMON[@]}" --draft-model $CK/dflash-drafter \
      --draft-lengths 7,15 --batch-size 1 --input-len 128 --output-len 64 --output-json $OUT/spec_cost_${tree}_$round.json \
      > $OUT/spec_cost_${tree}_$round.log 2>&1; echo "spec-cost $tree $round exit $?"
    cd - > /dev/null
  done
done
tail -n 12 $OUT/latency_*_1.log $OUT/spec_cost_*_1.log
