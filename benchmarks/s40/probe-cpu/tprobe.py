# ruff: noqa  (a measurement script kept as it was run, for the record)
"""isolation_probe with each benign latency's wall time recorded (into <out>.trace) and a row override."""
import json, sys, time, os
sys.path.insert(0, os.getcwd() + "/tools")
import isolation_probe as ip
trace = []
orig = ip._latencies
def _latencies(client, url, seconds, stop=None):
    chat, health = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        t = time.perf_counter()
        client.post(url + "/v1/chat/completions", json=ip.BENIGN, timeout=300).raise_for_status()
        chat.append(time.perf_counter() - t); trace.append(("chat", time.time(), chat[-1]))
        t = time.perf_counter()
        client.get(url + "/health", timeout=300)
        health.append(time.perf_counter() - t); trace.append(("health", time.time(), health[-1]))
    return chat, health
ip._latencies = _latencies
orig_run = ip._run_row
def _run_row(client, url, requests):
    trace.append(("row_start", time.time(), 0))
    r = orig_run(client, url, requests)
    trace.append(("row_end", time.time(), 0))
    return r
ip._run_row = _run_row
rows = ip._rows
mt = int(os.environ.get("P43_MAX_TOKENS", "200"))
def _rows():
    r = rows()
    r["n128_logprobs"][0][2]["max_tokens"] = mt
    return r
ip._rows = _rows
out = sys.argv[sys.argv.index("--out") + 1]
try:
    sys.exit(ip.main())
finally:
    json.dump(trace, open(out + ".trace", "w"))
