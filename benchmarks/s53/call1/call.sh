#!/usr/bin/env bash
# Prepared in session 52 (no device time was left to run it): hybrid speculation now replays a rejection's kept rows
# into the recurrent state before the next step (runtime/state_slots.py) instead of recomputing them in that step,
# which made it a mixed step run eagerly: session 52 call 5 measured a verify step with every draft rejected at
# 45.7 ms (K = 2) and 68.4 ms (K = 4) against 4.75 ms a plain step (Qwen3.5-9B shape, batch 1). (1) The hybrid
# CUDA tests (the replay on the GPU: n-gram verify steps from graphs, MTP); (2) the same spec-cost run again;
# (3) MTP at batch 1 with the model's own module (random weights: acceptance near zero, so the step cost); (4) prompt
# chunks through flash-linear-attention's chunk kernel (`--tuning gdn_prefill=fla`, its wheel carried in .whl) against
# Atlas's batched PyTorch form: TTFT at batch 1 of 2,048 tokens and of 256 prompts of 128.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 150 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py -n 3 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $OUT/tests.log; grep -E "^FAILED" $OUT/tests.log | head
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
COMMON=(--model /tmp/q9 --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096
        --max-num-seqs 4)
timeout 150 python3 -m atlas.cli bench spec-cost "${COMMON[@]}" --draft-lengths 2,4 --batch-size 1 --input-len 128 \
  --output-len 48 --output-json $OUT/spec_cost_q9.json > $OUT/spec_cost_q9.log 2>&1
echo "spec-cost exit $?"; tail -n 4 $OUT/spec_cost_q9.log
for spec in none mtp; do
  flags=(); [ $spec = mtp ] && flags=(--speculative mtp --num-draft-tokens 2 --speculative-policy always)
  timeout 90 python3 -m atlas.cli bench latency "${COMMON[@]}" --peer none --batch-size 1 --input-len 128 \
    --output-len 64 --num-iters 2 --num-iters-warmup 1 "${flags[@]}" --output-json $OUT/latency_$spec.json \
    > $OUT/latency_$spec.log 2>&1
  echo "latency $spec exit $?; $(grep -E 'atlas batch 1:' $OUT/latency_$spec.log | cut -c 30-)"
done
for kernel in atlas fla; do
  timeout 90 python3 -m atlas.cli bench latency "${COMMON[@]}" --peer none --batch-size 1 --input-len 2048 \
    --output-len 16 --num-iters 2 --num-iters-warmup 1 --tuning gdn_prefill=$kernel \
    --output-json $OUT/ttft2048_$kernel.json > $OUT/ttft2048_$kernel.log 2>&1
  echo "ttft 2048 $kernel exit $?; $(grep -E 'atlas batch 1:' $OUT/ttft2048_$kernel.log | cut -c 30-)"
  timeout 100 python3 -m atlas.cli bench latency --model /tmp/q9 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 256 --peer none --batch-size 256 \
    --input-len 128 --output-len 16 --num-iters 2 --num-iters-warmup 1 --tuning gdn_prefill=$kernel \
    --output-json $OUT/b256_$kernel.json > $OUT/b256_$kernel.log 2>&1
  echo "b256 $kernel exit $?; $(grep -E 'atlas batch 256:' $OUT/b256_$kernel.log | cut -c 30-)"
done
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
