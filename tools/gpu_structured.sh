#!/usr/bin/env bash
# Structured outputs on one GPU, from the repo root: the JSON-schema constraint's cost with each grammar engine
# (atlas bench structured, llguidance and xgrammar alternated in one run), then the structured-output tests on
# CUDA (the JSON Schema Test Suite with temperature-1 samples through the Triton mask kernel and CUDA graphs,
# the byte-level check, the error finish). Results: $OUT/structured_{llguidance,xgrammar}_{1,2}.json, $OUT/log.txt.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
BENCH=(bench structured --concurrency 1,32 --output-len 64 --repeats 3 --gpu-memory-utilization 0.2)
for round in 1 2; do
  for backend in xgrammar llguidance; do
    echo "== bench structured, $backend, round $round" | tee -a "$LOG"
    timeout 150 python3 -m atlas.cli "${BENCH[@]}" --structured-outputs-backend "$backend" \
      --output-json "$OUT/structured_${backend}_${round}.json" 2>&1 | grep -v Warning | tail -8 | tee -a "$LOG"
  done
done
for k in "test_json_schema_suite.py" "test_structured_engine.py -k byte_level or no_token or greedy_and_sampled"; do
  echo "== pytest $k (CUDA)" | tee -a "$LOG"
  if [ "${k#* }" = "$k" ]; then args=(); else args=(-k "${k#* -k }"); fi
  timeout 240 python3 -m pytest -q -p no:cacheprovider "tests/${k%% *}" "${args[@]}" 2>&1 | tail -5 | tee -a "$LOG"
done
