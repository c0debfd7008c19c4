#!/usr/bin/env bash
# Device call 3: the JSON-schema constraint's cost on the final sources, the TTFT timeline, the structured CUDA tests.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/site /tmp/spy
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
source tools/steps.sh; sources_hash > "$OUT/sources.txt" 2>&1
ROUNDS=1 BACKENDS="xgrammar auto" MASK_THREADS=default TESTS=none bash tools/gpu_structured.sh 2>&1 | tail -30
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 -m atlas.cli serve --model /tmp/q8 --load-format dummy --tokenizer atlas/assets/default-model \
  --gpu-memory-utilization 0.85 --max-model-len 4096 --port 8321 --no-access-log --api-server-count 2 \
  --enable-log-requests > /tmp/server.log 2>&1 &
spid=$!
for i in $(seq 1 240); do grep -q "listening on" /tmp/server.log && break; sleep 1; done
python3 tools/ttft_timeline.py --url http://127.0.0.1:8321 --server-log /tmp/server.log --concurrency 256 \
  --num-requests 1536 --processes 4 --out /tmp/spy/timeline_c256.json > "$OUT/timeline_c256.txt" 2>&1 &
tpid=$!
sleep 14
ps -eo pid,ppid,pcpu,args | cut -c1-150 > /tmp/spy/ps.txt
for pid in $(pgrep -P $spid) $(pgrep -P $tpid); do
  /tmp/site/bin/py-spy record --nonblocking -r 250 -d 6 -f raw -o "/tmp/spy/spy_$pid.txt" -p "$pid" > "/tmp/spy/spy_$pid.log" 2>&1 &
done
top -b -n 1 -d 3 | head -30 > /tmp/spy/top.txt
wait $tpid
cat "$OUT/timeline_c256.txt"
python3 tools/ttft_timeline.py --url http://127.0.0.1:8321 --server-log /tmp/server.log --concurrency 1 \
  --num-requests 24 --processes 1 --out /tmp/spy/timeline_c1.json > "$OUT/timeline_c1.txt" 2>&1
cat "$OUT/timeline_c1.txt"
kill -TERM $spid; wait $spid
cp /tmp/server.log /tmp/spy/
tar czf "$OUT/spy.tar.gz" -C /tmp spy
ls "$OUT"
