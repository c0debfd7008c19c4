#!/usr/bin/env bash
# Prepared in session 56. (1) MTP drafts through a token map (--speculative-token-map, new for mtp): the Qwen3.5-9B
# shape's LM head is 2.0 GB, read once a draft; batch-1 latency plain, MTP K = 2 (policy always) and MTP K = 2 with a
# map of 32,768 ids, one call. (Its DFlash part is call 4's.)
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
# (0) Session 57 call 1's three failures: test_fp32_on_cuda_equals_transformers_generate[*-False] asserted the old
# default (mixed-step graphs off); it now asserts they are on and ran.
cuda_tests hybrid_fp32 150 3 "tests/test_hybrid_cuda.py::test_fp32_on_cuda_equals_transformers_generate"
# (0b) Call 2 found the W8A16 kernel 2.5-3x slower than bf16 at 2-8 rows in the model; the table now sends them to
# W8A8: the FP8 CUDA tests again, and the Qwen3-8B shape at 1-8 rows with the new table.
cuda_tests fp8 200 3 tests/test_fp8_cuda.py tests/test_moe_fp8.py tests/test_mixed_graphs.py
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8f --config-only --fp8 block > /dev/null
timeout 100 python3 -m atlas.cli bench latency --model /tmp/q8f --load-format dummy --skip-tokenizer-init \
  --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none --batch-size 1,2,4,8 --input-len 128 \
  --output-len 64 --num-iters 3 --num-iters-warmup 1 --output-json $OUT/q8f_default.json > /tmp/logs/q8f.log 2>&1
echo "q8f default: exit $?; $(grep -E 'atlas batch [0-9]+:' /tmp/logs/q8f.log | cut -c 30- | tr '\n' ' ')"
python3 tools/make_random_checkpoint.py --shape qwen3.5-9b --out /tmp/q9 --config-only > /dev/null
python3 -c "import torch; torch.save(torch.arange(32768), '/tmp/map.pt')"
common=(--model /tmp/q9 --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096
        --max-num-seqs 8 --peer none --batch-size 1 --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1)
for run in "plain" "mtp" "mtp_map"; do
  extra=()
  [ $run != plain ] && extra=(--speculative mtp --num-draft-tokens 2 --speculative-policy always)
  [ $run = mtp_map ] && extra+=(--speculative-token-map /tmp/map.pt)
  timeout 120 python3 -m atlas.cli bench latency "${common[@]}" "${extra[@]}" --output-json $OUT/q9_$run.json \
    > /tmp/logs/q9_$run.log 2>&1
  echo "$run: exit $?; $(grep -E 'atlas batch 1:' /tmp/logs/q9_$run.log | cut -c 30-)"
done
# (a call brings back at most 8 files: one archive)
cd $OUT && tar czf results.tgz --remove-files *.json *.txt *.log 2>/dev/null; ls $OUT
