# Sourced by the tools/gpu_*.sh scripts and the device calls (benchmarks/sNN/callN) after they set PYTHONPATH: the
# wheels carried in .whl/ go on the path (the GPU machine cannot install from a registry, and the engine itself needs
# msgspec; `bash tools/fetch_server_wheels.sh` fills .whl/ here, and the device call carries it).
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /tmp/device_site_pip.txt 2>&1 || echo "tools/device_site.sh: installing .whl/ failed (/tmp/device_site_pip.txt)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  python3 -c "import msgspec" 2> /dev/null || echo "tools/device_site.sh: no .whl/ here and no msgspec: carry .whl"
fi

# cuda_tests NAME LIMIT WORKERS FILE...: the CUDA tests of FILE... in one pytest session with WORKERS pytest-xdist
# workers on this GPU, cut at LIMIT seconds; the log in $OUT/tests_NAME.log, its verdict and failures printed. (One
# session at a time: two sessions side by side refuse each other's memory plans.)
cuda_tests() {
  local name=$1 limit=$2 workers=$3; shift 3
  timeout "$limit" python3 -m pytest -q -m cuda "$@" -n "$workers" -p no:cacheprovider -rfE > "$OUT/tests_$name.log" 2>&1
  echo "$name tests exit $?; $(grep -E "[0-9]+ (passed|failed|skipped|errors?)" "$OUT/tests_$name.log" | tail -n 1)"
  grep -E "^FAILED|^ERROR" "$OUT/tests_$name.log" | head
}

# latency_rows NAME MODEL_DIR BATCHES [atlas bench latency args...]: `atlas bench latency` of a --config-only
# checkpoint with dummy weights (128 tokens in, 64 out, 3 timed passes after 1), its JSON in $OUT/NAME.json and log in
# $OUT/NAME.log, one line printed: [(batch, ms a step, of the roofline), ...].
latency_rows() {
  local name=$1 model=$2 batches=$3; shift 3
  timeout 120 python3 -m atlas.cli bench latency --model "$model" \
    --load-format dummy --skip-tokenizer-init --gpu-memory-utilization 0.85 --max-model-len 4096 --peer none \
    --batch-size "$batches" --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 \
    --output-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? at ${SECONDS}s; $(python3 -c "import json,sys; print([(r['batch_size'], round(r['ms_per_step'], 3), \
round(r['decode_roofline_fraction'], 3)) for r in json.load(open(sys.argv[1]))['rows']])" "$OUT/$name.json" 2>/dev/null)"
}
