#!/usr/bin/env bash
# Prepared in session 55: `atlas bench serve` of the Qwen3.5-9B shape at 64 streams, prompts of 128 random tokens
# arriving as others decode, with --tuning mixed_graph_recurrent_rows at 0 (mixed steps eager) and 128 (mixed steps
# whose sequences have at most 128 rows replay graphs), each against the offline engine in the same run (after
# call1's tests of those graphs pass).
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh  # (the server's wheels and flash-linear-attention, carried in .whl/)
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
for rows in 0 128; do
  timeout 200 python3 -m atlas.cli bench serve --model /tmp/q9 --load-format dummy \
    --tokenizer atlas/assets/default-model --gpu-memory-utilization 0.85 --max-model-len 4096 --num-requests 256 \
    --concurrency 64 --max-tokens 128 --api-server-count 1 --client-processes 4 --input-len 128 \
    --tuning mixed_graph_recurrent_rows=$rows --output-json $OUT/serve_q9_c64_rows$rows.json \
    > /tmp/logs/serve_rows$rows.log 2>&1
  echo "serve rows=$rows: exit $?"; tail -12 /tmp/logs/serve_rows$rows.log
done
