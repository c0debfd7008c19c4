#!/usr/bin/env bash
# Session 51, the last call: (1) the CUDA tests whose shared cases changed for CI's time (the MXFP4 decode check's
# layout, the GEMV cases' N) and test_cuda.py whole; (2) `atlas bench serve` at 256 streams, two front ends (the
# supervisor now imports the front ends' modules before forking them); (3) gpt-oss-20b with its experts
# dequantized to bf16 as they load (`--tuning moe_mxfp4=0`) against MXFP4 in the same call; (4) the Qwen3-30B-A3B
# shape with the rows form of down (the default since call 2) without PDL.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 200 python3 -m pytest -q -m cuda tests/test_moe_mxfp4.py tests/test_cuda.py -n 3 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $OUT/tests.log
INPUT_LEN=128 RUNS="256:1024:2" OUT=$OUT timeout 200 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1
grep -E "^serve_|requests ok|engine|offline" $OUT/serve.log | head -12
export PYTHONPATH=$PWD
for run in "gpt-oss-20b moe_mxfp4=1" "gpt-oss-20b moe_mxfp4=0" "qwen3-30b-a3b pdl=1" "qwen3-30b-a3b pdl=0"; do
  read -r shape knobs <<< "$run"
  [ -e /tmp/$shape ] || python3 tools/make_random_checkpoint.py --shape $shape --out /tmp/$shape --config-only > /dev/null
  timeout 70 python3 -m atlas.cli bench latency --model /tmp/$shape --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 --input-len 128 \
    --output-len 64 --num-iters 2 --num-iters-warmup 1 --tuning $knobs --output-json $OUT/${shape}_$knobs.json \
    > $OUT/${shape}_$knobs.log 2>&1
  echo "$shape $knobs: exit $?; $(grep -E 'atlas batch (1|64):' $OUT/${shape}_$knobs.log | tr '\n' ' ')"
done
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
