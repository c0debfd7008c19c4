#!/usr/bin/env bash
# Session 52: hybrid models (Qwen3.5 / Qwen3.6 / Qwen3-Next) replay decode and verify steps from CUDA graphs (the
# recurrent-state slots in the graphs' static buffers; the Triton recurrent kernel over 1 + K rows). (1) The hybrid
# CUDA tests; (2) the Qwen3.5-9B shape at batch 1 (dummy weights): 1,024 and 16,384 tokens of context (the linear
# layers' decode cost should not grow with it), TTFT of 2,048 tokens, and the same step eagerly (--enforce-eager),
# with a kernel profile of the graphed step.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 200 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py -n 3 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $OUT/tests.log
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
COMMON=(--model /tmp/q9 --load-format dummy --skip-tokenizer-init --peer none --gpu-memory-utilization 0.85
        --max-model-len 20000 --max-num-seqs 4 --batch-size 1 --output-len 64 --num-iters 2 --num-iters-warmup 1)
run() {  # name, extra flags...
  local name=$1; shift
  timeout 100 python3 -m atlas.cli bench latency "${COMMON[@]}" "$@" --output-json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch 1:' $OUT/$name.log)"
}
run q9_in1024 --input-len 1024 --profile $OUT/profiles
run q9_in2048 --input-len 2048
run q9_in16384 --input-len 16384
run q9_in1024_eager --input-len 1024 --enforce-eager
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
