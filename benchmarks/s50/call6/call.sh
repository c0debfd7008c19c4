#!/usr/bin/env bash
# Session 50, call 6: the MXFP4 decode as float32 bits (_e2m1: five integer operations and a multiply a code) and
# MXFP4's own pairs tile (1,024 columns). (1) The MXFP4 kernels' CUDA test at gpt-oss-20b's shapes. (2) The one-token
# MXFP4 expert kernels by BLOCK_K, each checked against the bf16 kernels over the dequantized weights. (3)
# gpt-oss-20b's batch-1 step (call 5: 6.57 ms; session 44, bf16 experts: 4.42 ms).
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 60 python3 -m pytest -q -m cuda tests/test_moe_mxfp4.py -p no:cacheprovider -rfE > $OUT/tests.log 2>&1
echo "exit $?" >> $OUT/tests.log; tail -n 2 $OUT/tests.log
timeout 50 python3 tools/moe_decode_kernel_bench.py --shape gpt-oss-20b --formats mxfp4 --block-k 512,1024,2048 \
  --warps 4 --out $OUT/kernels_gpt_oss.json > $OUT/kernels_gpt_oss.log 2>&1
cut -c1-250 $OUT/kernels_gpt_oss.log
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
timeout 60 python3 -m atlas.cli bench latency --model /tmp/oss --load-format dummy --skip-tokenizer-init \
  --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
  --num-iters 2 --num-iters-warmup 1 --output-json $OUT/b1_oss.json > $OUT/b1_oss.log 2>&1
echo "oss: exit $?; $(grep -E 'atlas batch 1:' $OUT/b1_oss.log | tail -1)"
tar -czf /tmp/call6.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call6.tgz $OUT/
