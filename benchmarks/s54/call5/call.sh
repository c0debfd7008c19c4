#!/usr/bin/env bash
# Session 54, the last of its device time (~250 s): after call 4, the rows after an in-step prefix-cache snapshot go
# through the recurrent kernel (one launch, a row count per sequence) instead of a second flash-linear-attention call
# per layer. (1) the Gated DeltaNet kernel tests (the tails, the varlen convolution, the recurrent kernel);
# (2) TTFT of 2,048 and 128 tokens as in call 4, without the profiler.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 60 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py -k "triton or snapshot" -n 3 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "tests exit $?"; grep -E "passed|failed" $OUT/tests.log | tail -n 1; grep -E "^FAILED|^ERROR" $OUT/tests.log | head
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
for len in 2048 128; do
  timeout 50 python3 -m atlas.cli bench latency --model /tmp/q9 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 4 --peer none --batch-size 1 \
    --input-len $len --output-len 32 --num-iters 2 --num-iters-warmup 1 --output-json $OUT/ttft${len}.json \
    > $OUT/ttft${len}.log 2>&1
  echo "ttft $len exit $?; $(grep -E 'atlas batch 1:' $OUT/ttft${len}.log | cut -c 30-)"
done
