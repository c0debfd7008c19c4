#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~2 min): issue 38's "DFlash step at batch 1 <= 1.2x a plain step".
# With the full LM head the step reads 1.221x the plain step's bytes (benchmarks/s77/README.md), so it would have to
# run nearer its roofline than plain decoding does; with a 32,768-id `--speculative-token-map` the drafter's head
# reads 0.27 GB of its 1.24 and the bytes fall to 1.157x. `atlas bench spec-cost` (K = 7, batch 1) without and with
# the map, one call, the plain step measured beside each.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only --dflash-drafter > /dev/null
python3 -c "import torch; torch.save(torch.arange(32768), '/tmp/map.pt')"
for run in full map; do
  extra=(); [ $run = map ] && extra=(--speculative-token-map /tmp/map.pt)
  timeout 150 python3 -m atlas.cli bench spec-cost --model /tmp/q8 --load-format dummy --skip-tokenizer-init \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --draft-model /tmp/q8/dflash-drafter --draft-lengths 7 \
    --batch-size 1 --input-len 128 --output-len 64 "${extra[@]}" \
    --output-json $OUT/spec_cost_$run.json > $OUT/spec_cost_$run.log 2>&1
  echo "spec-cost $run: exit $?"; tail -n 4 $OUT/spec_cost_$run.log | cut -c1-160
done
echo "done at ${SECONDS}s"
