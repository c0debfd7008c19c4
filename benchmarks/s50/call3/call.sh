#!/usr/bin/env bash
# Prepared in session 49 for the next GPU session: where a batch-1 MoE decode step goes (issue 41's 0.6-of-roofline
# target; section 7.1 left it at "the next measurement"). The Qwen3-30B-A3B shape, bf16 and block-FP8 experts, each
# with programmatic dependent launch on (default) and off (`--tuning pdl=0`, so a kernel's profiled time is its own,
# not its wait for the one before), four profiled steps each (`--profile`: kernels a step, time by kind); and the
# gpt-oss-20b shape with its experts' fused epilogue (bias + clamped SwiGLU) against the unfused path.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/moe-fp8 --config-only --fp8 block > /dev/null
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
# (gpt-oss: --load-format dummy draws MXFP4 experts, as its checkpoints hold; their gate|up bias and clamped SwiGLU
#  now in the fused kernel's epilogue, against the unfused path)
for run in bf16:/tmp/moe: bf16-nopdl:/tmp/moe:pdl=0 fp8:/tmp/moe-fp8: oss:/tmp/oss: oss-unfused:/tmp/oss:moe_fused_pairs=0; do
  IFS=: read -r name model knobs <<< "$run"
  timeout 90 python3 -m atlas.cli bench latency --model $model --load-format dummy --skip-tokenizer-init \
    --peer none --gpu-memory-utilization 0.85 --max-model-len 4096 --batch-size 1 --input-len 128 --output-len 64 \
    --num-iters 2 --num-iters-warmup 1 ${knobs:+--tuning $knobs} --profile $OUT/prof_$name --profile-steps 4 \
    --output-json $OUT/moe_b1_$name.json > $OUT/moe_b1_$name.log 2>&1
  echo "$name: exit $?; $(grep -E 'atlas batch 1:' $OUT/moe_b1_$name.log | tail -1)"
done
# bf16 prefill with the grouped kernel's row chunks by rows per expert (the default since call 2; call 2 timed
# bf16 at 16): TTFT of 64 x 128-token prompts and of one 2,048-token prompt.
common=(--model /tmp/moe --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096
        --peer none)
timeout 100 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 64 --input-len 128 --output-len 8 \
  --num-iters 2 --num-iters-warmup 1 --output-json $OUT/moe_bf16-auto_b64.json > $OUT/moe_bf16-auto_b64.log 2>&1
timeout 100 python3 -m atlas.cli bench latency "${common[@]}" --batch-size 1 --input-len 2048 --output-len 2 \
  --num-iters 5 --num-iters-warmup 1 --output-json $OUT/moe_bf16-auto_ttft.json > $OUT/moe_bf16-auto_ttft.log 2>&1
grep -hE "atlas batch (1|64):" $OUT/moe_bf16-auto_*.log
# (a call brings back few files: one archive)
tar -czf /tmp/call3.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call3.tgz $OUT/ && ls -la $OUT
