#!/usr/bin/env bash
# Where the server's TTFT goes, on the GPU machine (Qwen3-8B shape, random bf16 weights, the shipped tokenizer):
# `atlas serve` with --enable-log-requests, then tools/ttft_timeline.py at each of CONCURRENCY (default "256 1"),
# with py-spy (from the carried wheels, when there) recording the server's and the clients' processes for 6 s
# during the first. From the repo root, with the server's wheels in .whl/ (carried).
# Knobs: API (front ends, default 2), REQUESTS (at the first concurrency, default 1536; 24 at the others), EXTRA
# (more `atlas serve` flags). Results: $OUT/timeline_c<C>.txt, and $OUT/ttft.tar.gz with every request's times,
# the py-spy profiles, `top` and the server's log (few files come back from the machine: one archive).
set -uo pipefail
OUT=${OUT:-/tmp/out}
WORK=/tmp/ttft
mkdir -p "$OUT" /tmp/site "$WORK"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 -m atlas.cli serve --model /tmp/q8 --load-format dummy --tokenizer atlas/assets/default-model \
  --gpu-memory-utilization 0.85 --max-model-len 4096 --port 8321 --no-access-log --api-server-count "${API:-2}" \
  --enable-log-requests ${EXTRA:-} > "$WORK/server.log" 2>&1 &
server=$!
for _ in $(seq 1 300); do grep -q "listening on" "$WORK/server.log" && break; sleep 1; done
first=1
for c in ${CONCURRENCY:-256 1}; do
  n=$([ $first = 1 ] && echo "${REQUESTS:-1536}" || echo 24)
  python3 tools/ttft_timeline.py --url http://127.0.0.1:8321 --server-log "$WORK/server.log" --concurrency "$c" \
    --num-requests "$n" --processes $(( c < 4 ? 1 : 4 )) --out "$WORK/timeline_c$c.json" > "$OUT/timeline_c$c.txt" 2>&1 &
  load=$!
  if [ $first = 1 ] && [ -x /tmp/site/bin/py-spy ]; then
    sleep 14  # (the clients start 8 s after launch; then a few seconds of steady load)
    ps -eo pid,ppid,pcpu,args | cut -c1-150 > "$WORK/ps.txt"
    top -b -n 1 -d 3 | head -30 > "$WORK/top.txt"
    for pid in $(pgrep -P $server) $(pgrep -P $load); do
      /tmp/site/bin/py-spy record --nonblocking -r 250 -d 6 -f raw -o "$WORK/spy_$pid.txt" -p "$pid" \
        > "$WORK/spy_$pid.log" 2>&1 &
    done
  fi
  wait $load
  echo "== $c streams"; cat "$OUT/timeline_c$c.txt"
  first=0
done
kill -TERM $server; wait $server
tar czf "$OUT/ttft.tar.gz" -C /tmp ttft
