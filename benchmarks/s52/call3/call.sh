#!/usr/bin/env bash
# Session 52, after call 2 (graphs: Qwen3.5-9B batch-1 step 41.2 ms eager -> 6.95 ms, 0.54 of the roofline; the
# profile: 1,979 kernels a step, 2.9 ms of them elementwise and copies). The Gated DeltaNet step now takes four
# launches (the convolution over slots, the recurrent kernel computing its gates, the gated RMSNorm) and the
# zero-centred RMSNorms one each (with their residual add). (1) The CUDA tests of every model those norms serve
# (hybrids, Gemma 3, gpt-oss) and the fused-op kernels; (2) the Qwen3.5-9B shape: batch 1 at 1,024 (profiled),
# 2,048 (TTFT) and 16,384 tokens of context, and batches 64 and 256 at 128 in / 64 out.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 230 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py tests/test_fused_ops.py \
  tests/test_gpt_oss_cuda.py tests/test_sliding_window_cuda.py tests/test_kv_groups.py -n 4 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $OUT/tests.log; grep -E "^FAILED" $OUT/tests.log | head
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
COMMON=(--model /tmp/q9 --load-format dummy --skip-tokenizer-init --peer none --gpu-memory-utilization 0.85
        --max-model-len 20000 --output-len 64 --num-iters 2 --num-iters-warmup 1)
run() {  # name, extra flags...
  local name=$1; shift
  timeout 110 python3 -m atlas.cli bench latency "${COMMON[@]}" "$@" --output-json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch [0-9]+:' $OUT/$name.log | cut -c 30- | tr '\n' ' ')"
}
run q9_in1024 --max-num-seqs 4 --batch-size 1 --input-len 1024 --profile $OUT/profiles
run q9_in2048 --max-num-seqs 4 --batch-size 1 --input-len 2048
run q9_in16384 --max-num-seqs 4 --batch-size 1 --input-len 16384
run q9_b64_256 --max-num-seqs 256 --batch-size 64,256 --input-len 128
grep -h -A3 "^engine" $OUT/q9_*.txt | grep -v "^--"
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
