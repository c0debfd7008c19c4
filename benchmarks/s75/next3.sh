#!/usr/bin/env bash
# For the next session with a GPU (carry [".whl"]; ~2 min): where the Qwen3-8B shape's FP8 batch-1 step goes, each
# kernel's own time: call4.sh's bf16 and FP8 block profiles again, with PDL (the step time) and with `--tuning pdl=0`
# (under PDL the kernels' spans overlap: 7.3 ms of kernels in a 3.28 ms busy step), the files tarred (more come back).
set -u
here=$(dirname "$0")
bash "$here/call4.sh"
EXTRA="--tuning pdl=0" TAG=_nopdl bash "$here/call4.sh"
cd "$OUT" && tar czf prof.tgz prof_* lat_* && rm -rf prof_* lat_*
