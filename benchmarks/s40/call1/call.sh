#!/usr/bin/env bash
# Device call 1: where the server's TTFT at 256 streams goes.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/c8"
RUNS="256:1024:2 1:32:2" bash tools/gpu_serve.sh 2>&1 | tail -40
CLIENTS=8 RUNS="256:1024:2" EXTRA="--no-offline-peer" OUT=$OUT/c8 bash tools/gpu_serve.sh 2>&1 | tail -14
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m atlas.cli serve --model /tmp/q8 --load-format dummy --tokenizer atlas/assets/default-model \
  --gpu-memory-utilization 0.85 --max-model-len 4096 --port 8321 --no-access-log --api-server-count 2 > "$OUT/prof_server.log" 2>&1 &
spid=$!
for i in $(seq 1 240); do grep -q "listening on" "$OUT/prof_server.log" && break; sleep 1; done
python3 -m atlas.cli bench serve --url http://127.0.0.1:8321 --num-requests 3072 --concurrency 256 --max-tokens 256 \
  --client-processes 4 --no-offline-peer --output-json "$OUT/prof_bench.json" > "$OUT/prof_bench.log" 2>&1 &
bpid=$!
sleep 22
ps -eo pid,ppid,pcpu,args > "$OUT/ps.txt"
for pid in $(pgrep -P $spid) $(pgrep -P $bpid); do
  /tmp/site/bin/py-spy record --nonblocking -r 250 -d 8 -f raw -o "$OUT/spy_$pid.txt" -p "$pid" > "$OUT/spy_$pid.log" 2>&1 &
done
wait $bpid
tail -12 "$OUT/prof_bench.log"
kill -TERM $spid; wait $spid
ls -la "$OUT"
