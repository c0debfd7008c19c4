#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~5 min): the grouped expert kernel reading and writing rows by
# index, with the routing weights' sum in one kernel (moe_grouped_gather, built after session 87's calls), at
# gpt-oss-20b's 64 and 256 requests and Qwen3-30B-A3B's (bf16 experts), off and on alternated twice; then the MoE
# kernels' CUDA tests (tests/test_kernels.py: moe_cases' grouped cases read and write rows by index, bit for bit;
# moe_combine against its reference bit for bit; FusedExperts with the knob on against the reference) and the gpt-oss
# model's on a tree where it is on.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-30b-a3b --out /tmp/a3b --config-only > /dev/null
lat() {  # NAME MODEL [extra args...]
  local name=$1 model=$2; shift 2
  timeout 120 python3 -m atlas.cli bench latency --model $model \
    --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
    --batch-size 64,256 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json $OUT/$name.json "$@" > $OUT/$name.log 2>&1
  echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" $OUT/$name.json 2>/dev/null)"
}
lat oss_off1 /tmp/oss; lat oss_on1 /tmp/oss --tuning moe_grouped_gather=1
lat oss_off2 /tmp/oss; lat oss_on2 /tmp/oss --tuning moe_grouped_gather=1
lat a3b_off /tmp/a3b; lat a3b_on /tmp/a3b --tuning moe_grouped_gather=1
cuda_tests kernels 150 2 tests/test_kernels.py
mkdir -p /tmp/t/G && cp -r atlas tests tools pyproject.toml /tmp/t/G/ && sed -i \
  's/moe_grouped_gather: bool = field(default=False/moe_grouped_gather: bool = field(default=True/' /tmp/t/G/atlas/config.py \
  && grep -c 'moe_grouped_gather: bool = field(default=True' /tmp/t/G/atlas/config.py
(cd /tmp/t/G && PYTHONPATH=/tmp/t/G:$PYTHONPATH cuda_tests gpt_oss_gather 120 2 tests/test_gpt_oss_cuda.py)
echo "done at ${SECONDS}s"
