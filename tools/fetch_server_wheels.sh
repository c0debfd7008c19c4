#!/usr/bin/env bash
# The wheels the GPU machine needs for `atlas serve`, the structured-output engines and py-spy (it has no fastapi,
# uvicorn, uvloop, httptools, pydantic, pyzmq, msgspec, xgrammar or llguidance, and cannot install from a registry),
# downloaded into .whl/ for CPython 3.12 on x86-64 Linux, the versions this machine has installed where it has them. Each call that
# needs them carries .whl and installs them with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# and runs with PYTHONPATH=/tmp/site (tools/gpu_serve.sh, gpu_ttft.sh do both). The dependencies the GPU image lacks
# are listed too: fastapi 0.165 imports opentelemetry-api, xgrammar imports apache-tvm-ffi. flash-linear-attention
# (with fla-core and einops) is for measuring `--tuning gdn_prefill=fla` against Atlas's own prefill form.
# peft (with accelerate and psutil) is the LoRA tests' reference (tests/test_lora_cuda.py).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PACKAGES="fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn uvloop httptools pyzmq msgspec xgrammar
  apache-tvm-ffi llguidance opentelemetry-api jsonschema jsonschema-specifications referencing rpds-py sniffio py-spy
  flash-linear-attention fla-core einops peft accelerate psutil"
PLATFORMS=""
for n in 5 17 24 26 27 28 31 34 35; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
mkdir -p .whl
for name in $PACKAGES; do
  # the installed version where there is one (pip show fails for a package not installed here: take the newest)
  version=$({ python3 -m pip show "$name" 2>/dev/null || true; } | sed -n 's/^Version: //p')
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
    "$name${version:+==$version}"
done
ls .whl
