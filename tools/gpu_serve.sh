#!/usr/bin/env bash
# `atlas bench serve` on the GPU machine, Qwen3-8B shape (random bf16 weights drawn on the device, the shipped
# tokenizer), against the offline engine in the same run. From the repo root, with the server's wheels in .whl/
# (carried: the GPU machine cannot install from a registry). Results: $OUT/serve_c<C>_n<N>_api<A>.{json,txt}.
#
# Knobs: RUNS="256:1024:1 256:1024:2" (concurrency:requests:api-server-count[:tuning]; a tuning such as
# late_scheduling=1 goes to that run only as --tuning and into its file names, so A/B runs fit in one call; a row
# given again gets _2, _3 ... in its names), MAX_TOKENS (256), CLIENTS (client processes, 4; at most the
# concurrency), INPUT_LEN (prompts of that many random token ids, as issue 36's 128; default: the built-in code
# prefixes), EXTRA (more flags, every run).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site /tmp/logs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.txt" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
for run in ${RUNS:-256:1024:1 256:1024:2}; do
  IFS=: read -r c n a t <<< "$run"
  name="serve_c${c}_n${n}_api${a}${t:+_${t//[=,]/-}}"
  for k in 2 3 4 5 6 7 8 9; do [ -e "$OUT/$name.json" ] || break; name="${name%_[2-9]}_$k"; done
  python3 -m atlas.cli bench serve --model /tmp/q8 --load-format dummy --tokenizer atlas/assets/default-model \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --num-requests "$n" --concurrency "$c" \
    --max-tokens "${MAX_TOKENS:-256}" --api-server-count "$a" --client-processes $(( c < ${CLIENTS:-4} ? c : ${CLIENTS:-4} )) --server-log "/tmp/logs/$name.server.log" \
    --output-json "$OUT/$name.json" ${INPUT_LEN:+--input-len $INPUT_LEN} ${t:+--tuning $t} ${EXTRA:-} \
    > "/tmp/logs/$name.log" 2>&1
  echo "$name: exit $?"; tail -12 "/tmp/logs/$name.log"
  rm -f "$OUT/$name.txt"  # (the same as the log's end; files that come back are few)
done
tar czf "$OUT/serve_logs_$(date +%s).tar.gz" -C /tmp logs
# PROFILE=1: also the engine process under cProfile at concurrency 256 (tools/profile_serve.py), driven by the
# bench from K client processes (PROFILE_CLIENTS, default 4), without the offline peer.
if [ "${PROFILE:-0}" = 1 ]; then
  python3 tools/profile_serve.py serve --model /tmp/q8 --load-format dummy --tokenizer atlas/assets/default-model \
    --gpu-memory-utilization 0.85 --max-model-len 4096 --port 8321 --no-access-log > "$OUT/profile_server.log" 2>&1 &
  pid=$!
  for i in $(seq 1 240); do grep -q "listening on" "$OUT/profile_server.log" && break; sleep 1; done
  python3 -m atlas.cli bench serve --url http://127.0.0.1:8321 --num-requests 1024 --concurrency 256 \
    --max-tokens "${MAX_TOKENS:-256}" --client-processes "${PROFILE_CLIENTS:-4}" --no-offline-peer \
    --output-json "$OUT/profile_bench.json" > "$OUT/profile_bench.log" 2>&1
  tail -8 "$OUT/profile_bench.log"
  kill -TERM $pid; wait $pid
  head -60 "$OUT/engine_profile.txt"
fi
