#!/usr/bin/env bash
# Session 55: `atlas bench serve` at 256 and 1 streams (prompts of 128 random tokens, one front end) against the
# offline engine in the same run, on the tree whose engine start-up changed in session 54 (the capture check that
# DeepSeek-V4 MTP needed) after session 54's call 3 measured the server.
mkdir -p $OUT; export PYTHONPATH=$PWD
INPUT_LEN=128 RUNS="256:1024:1 1:16:1" OUT=$OUT timeout 560 bash tools/gpu_serve.sh > $OUT/serve.log 2>&1
echo "serve exit $?"; grep -E "^serve_|requests ok|engine|offline" $OUT/serve.log | head -16; rm -f $OUT/pip.txt
