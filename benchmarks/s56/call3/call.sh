#!/usr/bin/env bash
# Prepared in session 55: `atlas bench serve` of the Qwen3.5-9B shape at 64 streams, prompts of 128 random tokens
# arriving as others decode, with --tuning mixed_graph_recurrent_rows at 0 (mixed steps eager) and 128 (mixed steps
# whose sequences have at most 128 rows replay graphs), each against the offline engine in the same run (after
# call1's tests of those graphs pass).
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh  # (the server's wheels and flash-linear-attention, carried in .whl/)
# (first the DSA / MTP CUDA tests on the final tree of session 55: they passed on its starting tree, 09bcd82, and its
#  later commits changed the graph plan's construction and shared kernels; issue 42 is resolved once they pass)
timeout 200 python3 -m pytest -q -m cuda tests/test_dsa_mtp.py tests/test_dsa_triton.py tests/test_deepseek_cuda.py \
  -n 3 -p no:cacheprovider -rfE > $OUT/tests_dsa_mtp.log 2>&1
echo "DSA / MTP tests exit $?"; grep -E "passed|failed" $OUT/tests_dsa_mtp.log | tail -n 1
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
for rows in 0 128; do
  timeout 180 python3 -m atlas.cli bench serve --model /tmp/q9 --load-format dummy \
    --tokenizer atlas/assets/default-model --gpu-memory-utilization 0.85 --max-model-len 4096 --num-requests 256 \
    --concurrency 64 --max-tokens 128 --api-server-count 1 --client-processes 4 --input-len 128 \
    --tuning mixed_graph_recurrent_rows=$rows --output-json $OUT/serve_q9_c64_rows$rows.json \
    > /tmp/logs/serve_rows$rows.log 2>&1
  echo "serve rows=$rows: exit $?"; tail -12 /tmp/logs/serve_rows$rows.log
done
