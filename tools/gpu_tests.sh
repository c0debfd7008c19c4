#!/usr/bin/env bash
# The CUDA tests (`pytest -m cuda`), a file at a time on each GPU of the machine, the files spread over the
# GPUs by their expected minutes (about 3.5 minutes on two H200s, 6 on one). From the repo root.
# Results: $OUT/cuda_tests.txt (what passed and failed, written as each file ends) and $OUT/cuda_tests.tar.gz (every
# file's log).
#
# Knobs (environment): FILES="cuda:190 deepseek_cuda:140 fused_ops:70 dflash:30" (test files without
# tests/test_ and .py, each with its expected seconds, which also orders and balances them; a file's limit is
# twice that plus 60 s), GPUS (how many to use; default all), EXTRA_ENV (variables for every run, e.g.
# "TRITON_PRINT_AUTOTUNING=1"). CPU dry run (every file skips its CUDA tests): OUT=/tmp/t bash tools/gpu_tests.sh
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The engine imports msgspec, which the GPU image lacks: the carried server wheels (tools/fetch_server_wheels.sh,
# carry .whl), when there, go to /tmp/site first.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/atlas-cuda-tests}
FILES=${FILES:-"cuda:190 deepseek_cuda:140 fused_ops:70 dflash:30"}
GPUS=${GPUS:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}
# The physical GPUs behind indices 0..GPUS-1: the caller's CUDA_VISIBLE_DEVICES, when it names some, is kept.
IFS=, read -r -a devices <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( GPUS - 1 )))}"
START=$(date +%s)
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
source tools/steps.sh  # sources_hash

# Longest first, each to the GPU with the least expected work so far.
declare -a load queue
for ((g = 0; g < GPUS; g++)); do load[g]=0; queue[g]=""; done
for entry in $(tr ' ' '\n' <<< "$FILES" | sort -t: -k2 -rn); do
  best=0
  for ((g = 1; g < GPUS; g++)); do [ "${load[g]}" -lt "${load[best]}" ] && best=$g; done
  load[best]=$(( load[best] + ${entry##*:} ))
  queue[best]="${queue[best]} $entry"
done

run_queue() {  # run_queue GPU ENTRIES...
  local gpu=$1 entry name cap rc; shift
  for entry in "$@"; do
    name=${entry%%:*}; cap=$(( 2 * ${entry##*:} + 60 ))
    echo "[+$(( $(date +%s) - START ))s] gpu $gpu: test_$name.py (limit ${cap}s)"
    env CUDA_VISIBLE_DEVICES="${devices[gpu]}" ${EXTRA_ENV:-} timeout -k 10 "$cap" python3 -m pytest -q -m cuda \
      "tests/test_$name.py" -p no:cacheprovider -rfE --durations=5 > "$WORK/test_$name.log" 2>&1
    rc=$?
    echo "[+$(( $(date +%s) - START ))s] gpu $gpu: test_$name.py exit $rc$([ $rc = 124 ] && echo ' (timed out)'):" \
      "$(grep -E '^[0-9]+ (passed|failed|skipped)|passed|failed' "$WORK/test_$name.log" | tail -n 1)" \
      | tee -a "$OUT/cuda_tests.txt"  # (as each file ends: a run cut short still says what passed)
  done
}
{
  echo "CUDA tests, $(date -u +%Y-%m-%dT%H:%M:%SZ), $GPUS GPU(s)${EXTRA_ENV:+, $EXTRA_ENV}"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  sources_hash
} > "$WORK/summary.txt" 2>&1
cp "$WORK/summary.txt" "$OUT/cuda_tests.txt"
for ((g = 0; g < GPUS; g++)); do
  # shellcheck disable=SC2086 # (the queue is a list of words)
  [ -n "${queue[g]}" ] && run_queue "$g" ${queue[g]} > "$WORK/gpu$g.txt" 2>&1 &
done
wait
cat "$WORK"/gpu*.txt >> "$WORK/summary.txt"
grep -h -E "^(FAILED|ERROR) " "$WORK"/test_*.log >> "$WORK/summary.txt"
cp "$WORK/summary.txt" "$OUT/cuda_tests.txt"
tar -czf "$OUT/cuda_tests.tar.gz" -C "$WORK" .
cat "$WORK/summary.txt"
