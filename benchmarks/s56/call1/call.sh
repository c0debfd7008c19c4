#!/usr/bin/env bash
# Prepared in session 55 (its device time was spent): hybrid models' mixed steps from CUDA graphs (--tuning
# mixed_graph_recurrent_rows, off by default). (1) every hybrid CUDA test: the new kernel forms (row counts with
# in-step snapshots, the convolution's states written into the pool), fp32 tokens against transformers with those
# graphs, with prefix caching and with n-gram speculation, and the rest after the linear-attention layer's forward
# was split into methods; (2) TTFT of one 128- and one 512-token prompt with the knob off and on (session 55: 53 ms
# eagerly at 128). call3 measures the server. If the tests pass and TTFT and the server's throughput improve, make
# 128 the default (config help, README's tuning row, BENCHMARKS 14).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 300 python3 -m pytest -q -m cuda tests/test_hybrid_cuda.py tests/test_hybrid_mtp.py -n 6 -p no:cacheprovider \
  -rfE > $OUT/tests.log 2>&1
echo "tests exit $?"; grep -E "passed|failed" $OUT/tests.log | tail -n 1; grep -E "^FAILED|^ERROR|Error" $OUT/tests.log | head
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
mkdir -p /tmp/logs
# (a batch-1 prompt of 128 tokens is a mixed step of one sequence: with the knob its prefill replays a graph too)
# (and of 512: one sequence of 512 rows token by token in each linear-attention layer, against the chunked form)
for run in "128 0" "128 128" "512 0" "512 512"; do
  read -r len rows <<< "$run"
  timeout 100 python3 -m atlas.cli bench latency --model /tmp/q9 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 4 --peer none --batch-size 1 \
    --input-len $len --output-len 32 --num-iters 5 --num-iters-warmup 2 --tuning mixed_graph_recurrent_rows=$rows \
    --output-json $OUT/ttft${len}_rows$rows.json > /tmp/logs/ttft${len}_rows$rows.log 2>&1
  echo "ttft $len rows=$rows exit $?; $(grep -E 'atlas batch 1:' /tmp/logs/ttft${len}_rows$rows.log | cut -c 30-)"
done
