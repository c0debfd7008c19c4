#!/usr/bin/env bash
# Session 92 (carry [".whl"]; ~7 min, any card): the CUDA tests owed since the GQA attention kernel took the
# attention_fused_combine knob's pointer and constexpr (session 91, after its calls): the whole of tests/test_cuda.py
# (the knob's own cases and its CUDA-graph replay among them), then the batch-1 steps of the Qwen3-8B shape (bf16,
# FP8 block) and gpt-oss-20b with the knob off and on, alternated, two pairs each (MODELS, PAIRS: fewer, where the
# device time is short).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
FINAL=$OUT; OUT=/tmp/s92c; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
cuda_tests cuda ${TEST_LIMIT:-330} 1 tests/test_cuda.py
tar czf $FINAL/s92_combine.tgz -C /tmp s92c
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
python3 tools/make_random_checkpoint.py --shape gpt-oss-20b --out /tmp/oss --config-only > /dev/null
F="--tuning attention_fused_combine=1"
for m in ${MODELS:-q8 q8-fp8 oss}; do
  for i in $(seq ${PAIRS:-2}); do latency_rows ${m}_off$i /tmp/$m 1; latency_rows ${m}_on$i /tmp/$m 1 $F; done
  tar czf $FINAL/s92_combine.tgz -C /tmp s92c
done
echo "done at ${SECONDS}s"
