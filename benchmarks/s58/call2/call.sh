#!/usr/bin/env bash
# Prepared in session 57. FP8 decode at 2-8 rows: session 57 sent them to W8A8 (4.81 / 4.31 / 4.45 ms a Qwen3-8B step at
# batch 2 / 4 / 8 against bf16's 4.43 / 4.48 / 4.64; the W8A16 "dot" kernel ran 10.9-14.2). Not yet tried in the
# model at those rows: the CUDA-core GEMVs with a row axis ("sum", "xs"), which read W once for all the rows. Each
# config through --tuning fp8_gemv (row 1 keeps the table's), the Qwen3-8B shape at batch 2, 4, 8, bf16 first.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8f --config-only --fp8 block > /dev/null
one="1:sum-n4k2048w4s3"
for run in "q8 bf16 -" "q8f w8a8 -" "q8f sum4 $one;8:sum-n4k2048w4s3" "q8f sum8 $one;8:sum-n8k1024w4s3" \
           "q8f xs8 $one;8:xs-n8k128w4s4"; do
  read -r model name table <<< "$run"
  tuning=(); [ "$table" != - ] && tuning=(--tuning "fp8_gemv=$table")
  timeout 75 python3 -m atlas.cli bench latency --model /tmp/$model --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 2,4,8 --input-len 128 \
    --output-len 64 --num-iters 3 --num-iters-warmup 1 "${tuning[@]}" --output-json $OUT/${model}_$name.json \
    > /tmp/logs/${model}_$name.log 2>&1
  echo "$model $name: exit $?; $(grep -E 'atlas batch [0-9]+:' /tmp/logs/${model}_$name.log | cut -c 30- | sed 's/atlas.bench.latency: //' | tr '\n' ' ')"
done
# Session 58: `atlas bench serve` at 256 and 1 streams against the offline engine, after the scheduler's
# _release_out_of_window wrapper (d2edf9d; no serve run since).
RUNS="256:1024:1 1:12:1" bash tools/gpu_serve.sh 2>&1 | grep -E "exit|tok/s|engine|ratio|TTFT|TPOT" | head -40
cp /tmp/logs/*.log $OUT/
cd $OUT && tar czf results.tgz --remove-files *.json *.txt *.log 2>/dev/null; ls $OUT
