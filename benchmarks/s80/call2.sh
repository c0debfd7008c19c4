#!/usr/bin/env bash
# Session 80, call 2 (carry [".whl"]; ~8 min). Issue 41: the MXFP4 row-tiles kernels alone at gpt-oss-20b's shape in
# each decode form, step size and stage count, with the loops the device's Triton compiled them to
# (benchmarks/s80/mxfp4_forms_kernels.py). Issue 38: at 256 streams, a second plain engine against the first (the
# A/A row: what pairing two equal engines gives), then n-gram adaptive, each with 8 interleaved passes in A B, B A
# order (bench spec --interleave since this session), 6,200 KV pages an engine.
mkdir -p $OUT /tmp/logs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/s80/mxfp4_forms_kernels.py --out $OUT/forms.json > /tmp/logs/forms.log 2>&1
echo "forms: exit $?"; grep -v '"_sass"' /tmp/logs/forms.log | python3 -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except Exception: print(line.rstrip()[:300]); continue
    print(r['decode'], r['runs'], r['stages'], r.get('error', ''), *(f\"{k}={r[k]:.3g}\" for k in ('gate_up_us', 'gate_up_of_copy', 'down_us', 'down_of_copy', 'gate_up_max_diff', 'down_max_diff') if k in r),
          [(m['loop'], m['registers']) for m in r.get('gate_up_sass', []) if 'loop' in m], [(m['loop'], m['registers']) for m in r.get('down_sass', []) if 'loop' in m])
"
for methods in plain ngram; do
  POLICIES=adaptive METHODS=$methods CONC=256 EXTRA="--interleave --repeats 8 --num-gpu-blocks-override 6200" \
    timeout $(( 590 - SECONDS )) bash tools/gpu_spec_policy.sh
  mv $OUT/spec_adaptive.json $OUT/spec_$methods.json; mv $OUT/spec_adaptive.txt $OUT/spec_$methods.txt
  rm -f $OUT/spec_logs.tar.gz
done
echo "done at ${SECONDS}s"
