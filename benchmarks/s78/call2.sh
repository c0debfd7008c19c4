#!/usr/bin/env bash
# Session 78 call 2 (carry [".whl"]; ~9 min): issue 38's DFlash rows (random drafter, 64 and 256 streams, 6,200 KV
# pages an engine) after session 77's onset rate, then the n-gram rows at 1 and 16 streams, each interleaved with the
# plain engine (benchmarks/s77/next_policy_rows.sh).
mkdir -p $OUT/dflash $OUT/low
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT/dflash PART=dflash bash benchmarks/s77/next_policy_rows.sh
OUT=$OUT/low PART=ngram-low timeout $((590 - SECONDS)) bash benchmarks/s77/next_policy_rows.sh
echo "call done at ${SECONDS}s"
