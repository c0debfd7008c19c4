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
