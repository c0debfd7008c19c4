#!/usr/bin/env bash
# Prepared in session 53 (its device time was spent): (1) the hybrid CUDA tests with transformers' fp32 reference
# taken from a process without flash-linear-attention on its path (tests/hf_greedy_torch_path.py: in session 53
# call 3 that package's TF32 kernels, which transformers runs where it imports, put the Qwen3-Next reference off
# the exact argmax); (2) where a hybrid prompt's time goes: TTFT of one 128-token prompt was 261-274 ms in session 53
# (calls 1 and 3) against a 3.8 ms floor, and of 2,048 tokens 245 ms (flash-linear-attention) / 343 ms (Atlas's
# chunked delta rule), each prompt in two eager steps (its chunk ended at the prefix-cache snapshot point). Since
# then the snapshot is taken inside the step (one eager step a prompt), and the eager Gated DeltaNet path uploads its
# index lists without waiting for the device (kernels/gated_delta_rule.py _upload). `--profile` writes the prefill's
# kernels, host gaps and engine steps (atlas-prefill) beside the decode steps'.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 300 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py -n 6 -p no:cacheprovider -rfE \
  > $OUT/tests.log 2>&1
echo "tests exit $?"; grep -E "passed|failed" $OUT/tests.log | tail -n 1; grep -E "^FAILED|^ERROR" $OUT/tests.log | head
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
for run in "128 auto" "2048 auto" "2048 atlas"; do
  read -r len kernel <<< "$run"
  timeout 120 python3 -m atlas.cli bench latency --model /tmp/q9 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 4 --peer none --batch-size 1 \
    --input-len $len --output-len 32 --num-iters 2 --num-iters-warmup 1 --tuning gdn_prefill=$kernel \
    --profile $OUT/profile_${len}_$kernel --profile-steps 8 --output-json $OUT/ttft${len}_$kernel.json \
    > $OUT/ttft${len}_$kernel.log 2>&1
  echo "ttft $len $kernel exit $?; $(grep -E 'atlas batch 1:' $OUT/ttft${len}_$kernel.log | cut -c 30-)"
  grep -A3 "atlas-prefill" $OUT/ttft${len}_$kernel.log | head -4
done
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
