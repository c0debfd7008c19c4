#!/usr/bin/env bash
# Session 54, after call 1's profile of a hybrid prefill (Qwen3.5-9B shape, one 128-token prompt: 3,098 launches, 12.7 ms
# of device work in 176 ms; flash-linear-attention's call 1.6 ms of host time each, two a layer with the in-step
# snapshot, and its chunk map copied up from pageable memory in every layer): the eager step's short convolution is
# now one Triton launch over the step's rows plus one gathering new states and snapshots, the index tensors are built
# once a step and reused by every layer (AttentionMetadata.varlen_cache), and fla gets its chunk map and views of the
# rows. (1) the hybrid CUDA tests, with the varlen convolution's; (2) the same TTFT runs as call 1 (gdn_prefill=auto).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 300 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py -n 6 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "tests exit $?"; grep -E "passed|failed" $OUT/tests.log | tail -n 1; grep -E "^FAILED|^ERROR" $OUT/tests.log | head
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
for len in 128 2048; do
  timeout 120 python3 -m atlas.cli bench latency --model /tmp/q9 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 4 --peer none --batch-size 1 \
    --input-len $len --output-len 32 --num-iters 2 --num-iters-warmup 1 \
    --profile $OUT/profile_${len} --profile-steps 8 --output-json $OUT/ttft${len}.json > $OUT/ttft${len}.log 2>&1
  echo "ttft $len exit $?; $(grep -E 'atlas batch 1:' $OUT/ttft${len}.log | cut -c 30-)"
  grep -A3 "atlas-prefill" $OUT/ttft${len}.log | head -4
done
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
