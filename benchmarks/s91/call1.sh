#!/usr/bin/env bash
# Session 91, call 1 (carry [".whl"]; under 10 min on an H200). Every file into one archive ($OUT/s91_call1.tgz).
# 1. Issue 34: the Qwen3-8B shape's batch-1 decode step profiled, bf16 and FP8 block, with PDL off (each kernel's own
#    time) and on (the default: busy time and idle gaps); `latency_rows ... --profile`; and the step's skeleton (the
#    same kernels with a hidden size of 512: what they cost beside their bytes; benchmarks/s91/README.md).
# 2. The CUDA tests owed since sessions 88-90's kernel, layer and policy changes (as benchmarks/s91/tests.sh), if
#    that script has not run on another card first.
# 3. Issue 41 (session 90's call5.sh), in the time left: the MoE families' batch-1 steps with each one-row GEMV
#    shape's config timed at load (`--tuning gemv=auto`) against the fixed default, alternated; FP8 block Qwen3-8B
#    likewise (its LM head is a bf16 GEMV).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; source tools/device_site.sh; FINAL=$OUT; OUT=/tmp/s91a; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
pack() { tar czf $FINAL/s91_call1.tgz -C /tmp s91a; }
for s in gpt-oss-20b deepseek-v2-lite; do
  python3 tools/make_random_checkpoint.py --shape $s --out /tmp/$s --config-only > /dev/null
done
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --config-only > /dev/null
python3 tools/make_random_checkpoint.py --shape qwen3-8b --out /tmp/q8-fp8 --config-only --fp8 block > /dev/null
lat() { latency_rows "$1" "/tmp/$2" "${@:3}"; pack; }
for v in q8 q8-fp8; do lat prof_$v $v 1 --profile $OUT/prof_$v --tuning pdl=0; lat prof_pdl_$v $v 1 --profile $OUT/prof_pdl_$v; done
# each step's skeleton: every kernel of the shape's step (its layers, heads, experts and vocabulary) with a hidden
# size of 512 and small MLPs, so that its bytes take ~0.1 ms: what the kernels cost beside their bytes
skel() {  # NAME MODEL HIDDEN MLP [EXPERT_MLP]
  rm -rf /tmp/$2-skel; cp -r /tmp/$2 /tmp/$2-skel
  python3 -c "import json, sys; p = sys.argv[1] + '/config.json'; c = json.load(open(p)); \
c.update(hidden_size=int(sys.argv[2]), intermediate_size=int(sys.argv[3])); \
c.update({'moe_intermediate_size': int(sys.argv[4])} if 'moe_intermediate_size' in c else {}); \
json.dump(c, open(p, 'w'))" /tmp/$2-skel $3 $4 ${5:-0}
  lat skel_$1 $2-skel 1
}
skel q8 q8 512 1024; skel fp8 q8-fp8 512 1024; skel oss gpt-oss-20b 512 512; skel v2 deepseek-v2-lite 512 1024 256
[ "${TESTS:-1}" = 1 ] && (cd tests && timeout 170 python3 moe_mxfp4_cases.py gpt-oss-20b > $OUT/moe_mxfp4_cases.log 2>&1
 echo "moe_mxfp4_cases exit $? at ${SECONDS}s"; tail -n 4 $OUT/moe_mxfp4_cases.log)
[ "${TESTS:-1}" = 1 ] && cuda_tests oss_policy 200 2 tests/test_gpt_oss_cuda.py tests/test_speculation_policy.py; echo "at ${SECONDS}s"; pack
[ $SECONDS -lt 450 ] && { lat oss_d1 gpt-oss-20b 1; lat oss_auto gpt-oss-20b 1 --tuning gemv=auto; lat oss_d2 gpt-oss-20b 1; }
[ $SECONDS -lt 500 ] && { lat v2_d deepseek-v2-lite 1; lat v2_auto deepseek-v2-lite 1 --tuning gemv=auto; }
if [ $SECONDS -lt 530 ]; then lat fp8_d q8-fp8 1; lat fp8_auto q8-fp8 1 --tuning gemv=auto; fi
grep -h -i "gemv" $OUT/*.log | sort | uniq -c | head -20
pack; echo "done at ${SECONDS}s"
