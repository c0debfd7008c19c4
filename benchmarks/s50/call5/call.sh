#!/usr/bin/env bash
# Session 50, call 5. Call 3 found gpt-oss-20b's batch-1 step at 6.80 ms with its MXFP4 experts (4.42 ms with bf16
# experts in session 44): the MXFP4 tile was interleaved back from its nibble halves, through shared memory. The
# kernels now multiply the even and odd halves by x's even and odd columns. (1) The MXFP4 CUDA tests. (2) The
# one-token expert kernels, bf16 and MXFP4 weights, by BLOCK_K and warps (tools/moe_decode_kernel_bench.py), at
# gpt-oss-20b's and Qwen3-30B-A3B's shapes. (3) gpt-oss-20b's batch-1 step. (4) Qwen3-30B-A3B bf16 batch 1 with
# PDL's trigger after the wait (call 3: 4.07 ms with PDL, 3.72 ms without).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 150 python3 -m pytest -q -m cuda tests/test_moe_mxfp4.py tests/test_gpt_oss.py -k "mxfp4" -p no:cacheprovider \
  -rfE > $OUT/tests.log 2>&1; echo "exit $?" >> $OUT/tests.log; tail -n 2 $OUT/tests.log
timeout 100 python3 tools/moe_decode_kernel_bench.py --shape gpt-oss-20b --out $OUT/kernels_gpt_oss.json \
  > $OUT/kernels_gpt_oss.log 2>&1
timeout 60 python3 tools/moe_decode_kernel_bench.py --shape qwen3-30b-a3b --block-k 512,1024,2048 \
  --out $OUT/kernels_qwen3.json > $OUT/kernels_qwen3.log 2>&1
cut -c1-230 $OUT/kernels_*.log
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe --config-only > /dev/null
for run in oss:/tmp/oss: moe-after-wait:/tmp/moe:pdl_trigger=after-wait moe:/tmp/moe:; do
  IFS=: read -r name model knobs <<< "$run"
  timeout 80 python3 -m atlas.cli bench latency --model $model --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 2 --num-iters-warmup 1 ${knobs:+--tuning $knobs} --output-json $OUT/b1_$name.json \
    > $OUT/b1_$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1_$name.log | tail -1)"
done
tar -czf /tmp/call5.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call5.tgz $OUT/
