#!/usr/bin/env bash
# Session 56: (1) the DSA / MTP CUDA tests on the final tree (issue 42) and, beside them, the hybrid CUDA tests again
# after the MoE experts take the Triton kernels at every token count inside a CUDA graph where the grouped GEMM
# cannot run (call1: the fp32 Qwen3-Next mixed-step graphs failed to capture above 64 tokens); (2) `atlas bench
# serve` of the Qwen3.5-9B shape at 64 streams, prompts of 128 random tokens arriving as others decode, with --tuning
# mixed_graph_recurrent_rows at 0 (mixed steps eager) and 128 (mixed steps of up to 128 rows a sequence replay
# graphs), server against server in one call.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh  # (the server's wheels and flash-linear-attention, carried in .whl/)
timeout 280 python3 -m pytest -q -m cuda tests/test_dsa_mtp.py tests/test_dsa_triton.py tests/test_deepseek_cuda.py \
  -n 3 -p no:cacheprovider -rfE > $OUT/tests_dsa_mtp.log 2>&1 &
dsa=$!
timeout 280 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py -n 6 -p no:cacheprovider -rfE \
  > $OUT/tests_hybrid.log 2>&1
echo "hybrid tests exit $?"; grep -E "passed|failed" $OUT/tests_hybrid.log | tail -n 1; grep -E "^FAILED|^ERROR" $OUT/tests_hybrid.log | head
wait $dsa
echo "DSA / MTP tests exit $?"; grep -E "passed|failed" $OUT/tests_dsa_mtp.log | tail -n 1; grep -E "^FAILED|^ERROR" $OUT/tests_dsa_mtp.log | head
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
for rows in 0 128; do
  timeout 140 python3 -m atlas.cli bench serve --model /tmp/q9 --load-format dummy --no-offline-peer \
    --tokenizer atlas/assets/default-model --gpu-memory-utilization 0.85 --max-model-len 4096 --num-requests 256 \
    --concurrency 64 --max-tokens 128 --api-server-count 1 --client-processes 4 --input-len 128 \
    --tuning mixed_graph_recurrent_rows=$rows --output-json $OUT/serve_q9_c64_rows$rows.json \
    > /tmp/logs/serve_rows$rows.log 2>&1
  echo "serve rows=$rows: exit $?"; tail -8 /tmp/logs/serve_rows$rows.log
done
