#!/usr/bin/env bash
# Session 52, after call 3 (Qwen3.5-9B batch 1: 4.69 ms a step at 1,024 tokens, 0.81 of the roofline; 16,384 and
# batch 64 unreadable: the bench took the decode as (total - TTFT), and the eager prefill of a hybrid varied by more;
# batch 256 ran out of time in a 16.5 s prefill of one sequence at a time). Now the bench times decode steps inside the
# run and prompt chunks go through the chunked delta rule batched. (1) The CUDA tests of call 2 and 3 that failed
# (the verify steps through graphs, hybrid MTP, Gemma 3 with KV cache groups); (2) Qwen3.5-9B at batch 1 with 16,384
# tokens of context and at batches 64 and 256; (3) the Qwen3.6-35B-A3B shape at batches 1, 64 and 256.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 130 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py tests/test_kv_groups.py -n 4 \
  -p no:cacheprovider -rfE > $OUT/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $OUT/tests.log; grep -E "^FAILED" $OUT/tests.log | head
for shape in qwen3.5-9b qwen3.6-35b-a3b; do
  python3 tools/make_random_checkpoint.py --shape $shape --out /tmp/$shape --config-only > /dev/null
done
run() {  # name, timeout, flags...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m atlas.cli bench latency --load-format dummy --skip-tokenizer-init --peer none \
    --gpu-memory-utilization 0.85 --output-len 64 --num-iters 2 --num-iters-warmup 1 "$@" --output-json $OUT/$name.json \
    > $OUT/$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch [0-9]+:' $OUT/$name.log | cut -c 30- | tr '\n' ' ')"
}
run q9_in16384 60 --model /tmp/qwen3.5-9b --max-model-len 17000 --max-num-seqs 4 --batch-size 1 --input-len 16384
run q9_b64_256 100 --model /tmp/qwen3.5-9b --max-model-len 4096 --max-num-seqs 256 --batch-size 64,256 --input-len 128
run q36_b1_64_256 120 --model /tmp/qwen3.6-35b-a3b --max-model-len 4096 --max-num-seqs 256 --batch-size 1,64,256 \
  --input-len 128
grep -h -A4 "^engine" $OUT/q*.txt | grep -v "^--"
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
