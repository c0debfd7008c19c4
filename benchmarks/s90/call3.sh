#!/usr/bin/env bash
# Session 90, call 3 (carry [".whl"]; ~2 min on an H200): issue 38's DFlash policy rows (session 77's script, its
# dflash part: DFlash adaptive with the random drafter against plain at 64 and 256 streams, interleaved, 4 passes).
FINAL=$OUT; mkdir -p /tmp/s90c
OUT=/tmp/s90c PART=dflash timeout 420 bash benchmarks/s77/next_policy_rows.sh 2>&1 | tail -30
tar czf $FINAL/s90_third.tgz -C /tmp s90c; echo "done at ${SECONDS}s"
