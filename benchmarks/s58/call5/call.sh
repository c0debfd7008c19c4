#!/usr/bin/env bash
# Session 58. Call 4 showed the random DFlash drafter at 0.955x plain at one request: 63 of 2,048 steps drafted (a
# probe every ~37 steps), each costing about 2.3 plain steps in all against the 1.4 of a verify step among verify
# steps, which is what the policy spaced its probes by. Now a lone probe's cost is measured apart (the four launch
# periods around it: SpeculationPolicy._measure_probe) and spaces the probes. The same rows as call 4 (2 timed
# passes a row), then the policy's CUDA test.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
POLICIES=adaptive METHODS=ngram,dflash CONC=1,16,64,256 EXTRA="--repeats 2" timeout 330 bash tools/gpu_spec_policy.sh
source tools/device_site.sh
cuda_tests policy 100 1 tests/test_speculation_policy.py
