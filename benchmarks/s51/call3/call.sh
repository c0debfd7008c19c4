#!/usr/bin/env bash
# Prepared in session 50: issue 42's DSA figures, now that the DSA Triton kernels passed their CUDA tests (session 50,
# call 1). The DeepSeek-V3.2 shape cut to one GPU, batch-1 decode at 2k, 16k and 64k context with DSA against the
# same model as dense MLA, TTFT of the 16k prompt, profiles of the decode steps (the indexer's share):
# tools/gpu_dsa.sh. (DSA steps run eagerly: the indexer's scores are sized by the step's longest context, a host
# number, so its CUDA graphs are not captured yet; the dense twin replays graphs.) Session 51 cut the contexts to 2k
# and 16k for time.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
# (session 51 first: moe_down_rows on by default after call 2 (Qwen3-30B-A3B batch 1 4.08 -> 3.19 ms): the MoE CUDA
#  tests on the new default, and the FP8 Qwen3-30B-A3B step with the rows form and without)
timeout 150 python3 -m pytest -q -m cuda tests/test_moe_fp8.py tests/test_deepseek_cuda.py tests/test_gpt_oss.py \
  tests/test_moe_mxfp4.py -n 3 -p no:cacheprovider -rfE > $OUT/tests.log 2>&1
echo "tests exit $?"; tail -n 1 $OUT/tests.log
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe-fp8 --config-only --fp8 block > /dev/null
for knobs in moe_down_rows=1 moe_down_rows=0; do
  timeout 60 python3 -m atlas.cli bench latency --model /tmp/moe-fp8 --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1,64 --input-len 128 \
    --output-len 64 --num-iters 2 --num-iters-warmup 1 --tuning $knobs --output-json $OUT/fp8_$knobs.json \
    > $OUT/fp8_$knobs.log 2>&1
  echo "fp8 $knobs: exit $?; $(grep -E 'atlas batch (1|64):' $OUT/fp8_$knobs.log | tr '\n' ' ')"
done
OUT=$OUT CONTEXTS="2048 16384" timeout 330 bash tools/gpu_dsa.sh > $OUT/gpu_dsa.log 2>&1
echo "exit $?" >> $OUT/gpu_dsa.log
grep -E "^== |atlas batch 1:|exit" $OUT/gpu_dsa.log
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
