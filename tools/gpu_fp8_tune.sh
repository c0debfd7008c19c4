#!/usr/bin/env bash
# FP8 linear kernels on the GPU machine, one run of at most ~4 minutes (H200): measures the candidates that
# atlas/kernels/fp8_linear.py's table of tuned choices picks among, and checks the kernels. From the repo root:
#
#   OUT=/tmp/out bash tools/gpu_fp8_tune.sh
#
# Parts, each under its own timeout (a failure or a timeout leaves the others' results):
#   1. gemv  (`atlas bench fp8 --part gemv`): every small-M config at 1, 2, 4, 8 rows on Qwen3-8B's projections, against
#      the bandwidth roofline and bf16 (cuBLAS, the bf16 GEMV), gate|up's SiLU epilogue -> $OUT/fp8_gemv.json
#   2. gemm  (`--part gemm`): bf16 torch.matmul, W8A16, the Triton W8A8 GEMM's tiles and cuBLASLt block scaling
#      (torch._scaled_mm 1x128 x 128x128) at M = 16 .. 8192, the fused activation quantization against PyTorch's
#      ops -> $OUT/fp8_gemm.json
#   3. summary: the table block to paste into fp8_linear.py and the headline numbers -> $OUT/summary.txt
#   4. the FP8 kernel CUDA tests (tests/test_fp8_cuda.py -k kernels: every kernel against its reference)
#   5. the rest of tests/test_fp8_cuda.py (tiny FP8 models under CUDA graphs), with the time left
# Knobs: TOTAL (seconds for everything, 260), GEMV_DEADLINE (90), GEMM_DEADLINE (35), ROWS (1,2,4,8),
# GEMM_M (16,64,256,2048,8192), APPLY (1: write the table into atlas/kernels/fp8_linear.py after part 3, with
# tools/apply_fp8_table.py, and copy the file to $OUT, so that the tests and what runs next use it).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
TOTAL=${TOTAL:-260}
start=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - start) )); }
note() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

# part NAME LIMIT_SECONDS COMMAND...: runs COMMAND under `timeout`, its output in $OUT/NAME.log
part() {
  local name=$1 limit=$2; shift 2
  if (( limit < 10 )); then note "$name: skipped (no time left)"; return; fi
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  note "$name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)') in $(( $(date +%s) - t0 )) s"
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$OUT/versions.txt" 2>&1
note "$(tr '\n' ';' < "$OUT/versions.txt")"

part gemv $(( $(left) < 110 ? $(left) : 110 )) python3 -m atlas.cli bench fp8 --part gemv --rows "${ROWS:-1,2,4,8}" \
  --deadline "${GEMV_DEADLINE:-90}" --output-json "$OUT/fp8_gemv.json"
part gemm $(( $(left) < 55 ? $(left) : 55 )) python3 -m atlas.cli bench fp8 --part gemm --m "${GEMM_M:-16,64,256,2048,8192}" \
  --deadline "${GEMM_DEADLINE:-35}" --output-json "$OUT/fp8_gemm.json"
timeout 30 python3 -m atlas.cli bench fp8 --part summary --gemv-json "$OUT/fp8_gemv.json" --gemm-json "$OUT/fp8_gemm.json" \
  --output-json "$OUT/summary_table.txt" > /dev/null 2> "$OUT/summary_error.log"
cat "$OUT/summary_table.txt" >> "$OUT/summary.txt" 2> /dev/null
if [ "${APPLY:-0}" = 1 ]; then  # the table written into the sources, so that what runs next in this call uses it
  python3 tools/apply_fp8_table.py --gemv-json "$OUT/fp8_gemv.json" --gemm-json "$OUT/fp8_gemm.json" \
    > "$OUT/applied.txt" 2>&1 && cp atlas/kernels/fp8_linear.py "$OUT/fp8_linear.py"
  note "table applied: exit $? ($OUT/fp8_linear.py)"
fi
part kernel_tests $(( $(left) - 25 < 90 ? $(left) - 25 : 90 )) python3 -m pytest -m cuda -q -x -p no:cacheprovider \
  tests/test_fp8_cuda.py -k kernels
tail -3 "$OUT/kernel_tests.log" >> "$OUT/summary.txt" 2> /dev/null
part model_tests $(( $(left) - 5 )) python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_fp8_cuda.py -k "not kernels"
tail -3 "$OUT/model_tests.log" >> "$OUT/summary.txt" 2> /dev/null
note "total $(( $(date +%s) - start )) s"
cat "$OUT/summary.txt"
