#!/usr/bin/env bash
# Structured outputs on one GPU, from the repo root: the JSON-schema constraint's cost with each grammar engine
# (atlas bench structured, each of BACKENDS alternated in one run, two rounds), then the structured-output tests
# on CUDA, one engine per process (each takes 0.9 of the GPU): the JSON Schema Test Suite with temperature-1
# samples through the Triton mask kernel and CUDA graphs, the byte-level check, the error finish.
# MASK_THREADS (default "default 0 12"): the llguidance run once per value of --structured-outputs-mask-threads
# (llguidance's threads for a step's masks; default: the engine's choice, a quarter of the CPUs up to 8; 0: none;
# 12: llguidance's own default on 16 CPUs, the runs before it), as structured_llguidance-tN_ROUND.
# ROUNDS (default 2), TESTS (default: the four below; "none" for none).
# Results: $OUT/structured_BACKEND_ROUND.json, $OUT/log.txt.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source tools/device_site.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
BENCH=(bench structured --concurrency 1,32 --output-len 64 --repeats 3 --gpu-memory-utilization 0.2)
for round in $(seq 1 "${ROUNDS:-2}"); do
  for backend in ${BACKENDS:-xgrammar llguidance auto}; do
    for threads in $([ "$backend" = llguidance ] && echo "${MASK_THREADS:-default 0 12}" || echo default); do
      name=$backend extra=()
      if [ "$threads" != default ]; then name=$backend-t$threads extra=(--structured-outputs-mask-threads "$threads"); fi
      echo "== bench structured, $name, round $round" | tee -a "$LOG"
      timeout 150 python3 -m atlas.cli "${BENCH[@]}" --structured-outputs-backend "$backend" ${extra[@]+"${extra[@]}"} \
        --output-json "$OUT/structured_${name}_${round}.json" 2>&1 | grep -E "^(run|json|uncon)" | tee -a "$LOG"
    done
  done
done
for t in ${TESTS:-test_json_schema_suite.py::test_every_schema_is_enforced_or_refused \
         test_structured_engine.py::test_byte_level_tokenizer_at_temperature_one_never_leaves_the_schema \
         test_structured_engine.py::test_a_grammar_state_with_no_token_ends_the_request_with_an_error \
         test_structured_engine.py::test_json_schema_greedy_and_sampled_outputs_validate}; do
  [ "$t" = none ] && break
  echo "== pytest $t (CUDA)" | tee -a "$LOG"
  timeout 240 python3 -m pytest -q -p no:cacheprovider "tests/$t" 2>&1 | grep -E "^E |passed|failed" | head -20 | tee -a "$LOG"
done
