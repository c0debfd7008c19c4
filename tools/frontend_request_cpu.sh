#!/usr/bin/env bash
# The HTTP front end's CPU time per request (issue 36: a wave of arrivals is handed to the engine one request at a
# time per front end, so this cost spreads a burst out). From the repo root: starts `atlas serve` with one front end
# (the shipped model unless MODEL is set), warms it, sends N (600) streaming completions of 128 random token ids and
# T (1) output tokens at C (64) in flight, and prints the front end's utime + stime (from /proc) for them.
# Knobs: MODEL, N, T, C, PORT (8377), EXTRA (more `atlas serve` flags).
set -uo pipefail
PORT=${PORT:-8377}
MODEL=${MODEL:-atlas/assets/default-model}
LOG=$(mktemp)
python3 -m atlas.cli serve --model "$MODEL" --port "$PORT" --api-server-count 1 --max-num-seqs "${C:-64}" \
  ${EXTRA:-} > "$LOG" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 1 120); do grep -q "listening on" "$LOG" && break; sleep 1; done
bench() {
  python3 -m atlas.cli bench serve --url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" --input-len 128 \
    --no-offline-peer --num-requests "$1" --concurrency "$2" --max-tokens "${T:-1}"
}
bench 50 16 > /dev/null 2>&1  # (warm-up; the preprocessing worker starts)
# The front end: the serve process's child that has the preprocessing worker under it.
worker=$(pgrep -f "atlas.server.preprocess_workers" -P "$(pgrep -d, -P $server)" | head -1)
front=$(ps -o ppid= -p "$worker" | tr -d ' ')
ticks() { awk '{print $14 + $15}' "/proc/$front/stat"; }
before=$(ticks)
bench "${N:-600}" "${C:-64}" 2>&1 | grep -E "requests/s|TTFT"
after=$(ticks)
hz=$(getconf CLK_TCK)
python3 -c "t=($after-$before)/$hz; n=${N:-600}; print(f'front end (pid $front): {t:.2f} s CPU for {n} requests, {1000*t/n:.2f} ms a request')"
