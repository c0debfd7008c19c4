#!/usr/bin/env bash
# Session 61 call 5 (not run in session 61: the device went away; owed): the draft model drafting right behind the
# verify step (89d7e21), the shared verify outcome (de2c30f) and the bookkeeping of drafts queued behind verify steps
# that DFlash now shares (1595c43, e50767a), all after call 2: the drafters' CUDA tests (call 2's eight, whose
# draft-model test now asserts its steps were queued behind verify steps), DFlash's CUDA tests, and `atlas bench spec-cost` on
# the Qwen3-8B shape with the random Qwen3-0.6B-shaped draft model (K = 3, batch 1 and 16; call 1's draft_graphs row
# is the same without drafting behind). Carry [".whl"].
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
timeout 240 python3 -m pytest -v -m cuda -k "mtp or eagle3 or drafting or decode_steps" -n 4 -p no:cacheprovider -rfE \
  tests/test_eagle3.py tests/test_draft_model_proposer.py tests/test_deepseek_cuda.py tests/test_dsa_mtp.py \
  tests/test_hybrid_mtp.py tests/test_mla_kv_cache_dtype.py > $OUT/tests_draft_model.log 2>&1
echo "tests exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests_draft_model.log | cut -c1-200 | tail -10
timeout 200 python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider -rfE tests/test_dflash.py > $OUT/tests_dflash.log 2>&1
echo "dflash tests exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests_dflash.log | tail -5
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-0.6b --out /tmp/q06 --config-only > /dev/null
timeout 90 python3 -m atlas.cli bench spec-cost --model /tmp/q8 --load-format dummy --skip-tokenizer-init \
  --speculative draft_model --draft-model /tmp/q06 --draft-lengths 3 --batch-size 1,16 --input-len 128 --output-len 64 \
  --num-iters 3 --gpu-memory-utilization 0.85 --max-model-len 4096 --output-json $OUT/draft_behind.json \
  > $OUT/draft_behind.log 2>&1
echo "draft_behind: exit $?"; cat $OUT/draft_behind.txt 2>/dev/null | cut -c1-200
