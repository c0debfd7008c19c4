#!/usr/bin/env bash
# Device call 1 (session 41): the server after the per-front-end sockets and the detokenizer fast path.
set -u
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
PYTHONPATH=/tmp/site python3 -c "import fastapi, uvicorn, zmq, msgspec, xgrammar, llguidance, jsonschema; print('imports ok')" || exit 1
RUNS="256:1024:2 1:32:2" timeout 300 bash tools/gpu_serve.sh 2>&1 | tail -30
API=2 REQUESTS=1024 timeout 200 bash tools/gpu_ttft.sh 2>&1 | tail -30
ls -la "$OUT"
