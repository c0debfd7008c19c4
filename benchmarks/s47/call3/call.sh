#!/usr/bin/env bash
# Device call 3 (session 47): call 2's speculation-policy table again, with the carried wheels on the path
# (tools/device_site.sh: the engine needs msgspec, which the GPU machine lacks; call 2's run stopped at the import).
mkdir -p $OUT
POLICIES=adaptive timeout 560 bash tools/gpu_spec_policy.sh > $OUT/spec.log 2>&1
tail -40 $OUT/spec.log
