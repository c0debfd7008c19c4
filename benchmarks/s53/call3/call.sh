#!/usr/bin/env bash
# Session 53, after call 1: (1) the hybrid CUDA tests again with room to finish (call 1 stopped them at 150 s with 9
# of 17 run, two failed), now with the replay of kept rows from CUDA graphs (runtime/state_slots.py) and the state
# pools stacked per spec (a copy between slots: one launch per kind); (2) spec-cost at K = 2, 4 (call 1: 16.7 and
# 15.6 ms against 4.74 plain, the replay eager) and batch-1 MTP (call 1: 15.8 ms a step against 4.67 plain).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 330 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py -n 6 -p no:cacheprovider -rfE \
  --durations=20 > $OUT/tests.log 2>&1
echo "tests exit $?"; grep -E "passed|failed" $OUT/tests.log | tail -n 2; grep -E "^FAILED|^ERROR" $OUT/tests.log | head
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
COMMON=(--model /tmp/q9 --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096
        --max-num-seqs 4)
timeout 120 python3 -m atlas.cli bench spec-cost "${COMMON[@]}" --draft-lengths 2,4 --batch-size 1 --input-len 128 \
  --output-len 48 --output-json $OUT/spec_cost_q9.json > $OUT/spec_cost_q9.log 2>&1
echo "spec-cost exit $?"; tail -n 4 $OUT/spec_cost_q9.log
for spec in none mtp; do
  flags=(); [ $spec = mtp ] && flags=(--speculative mtp --num-draft-tokens 2 --speculative-policy always)
  timeout 80 python3 -m atlas.cli bench latency "${COMMON[@]}" --peer none --batch-size 1 --input-len 128 \
    --output-len 64 --num-iters 2 --num-iters-warmup 1 "${flags[@]}" --output-json $OUT/latency_$spec.json \
    > $OUT/latency_$spec.log 2>&1
  echo "latency $spec exit $?; $(grep -E 'atlas batch 1:' $OUT/latency_$spec.log | cut -c 30-)"
done
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
