# Sourced by the tools/gpu_*.sh scripts after they set PYTHONPATH: the wheels carried in .whl/ go on the path (the GPU
# machine cannot install from a registry, and the engine itself needs msgspec; `bash tools/fetch_server_wheels.sh`
# fills .whl/ here, and the device call carries it).
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /tmp/device_site_pip.txt 2>&1 || echo "tools/device_site.sh: installing .whl/ failed (/tmp/device_site_pip.txt)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  python3 -c "import msgspec" 2> /dev/null || echo "tools/device_site.sh: no .whl/ here and no msgspec: carry .whl"
fi
