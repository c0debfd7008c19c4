#!/usr/bin/env bash
# On the GPU machine, from the repo root: train the default model and its DFlash drafter, install both
# into atlas/assets/default-model, then benchmark them. Results come back as a few files under $OUT.
# STDLIB_TAR: a tar.xz of a Python standard library to train on (default: the running Python's).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source tools/device_site.sh
OUT=${OUT:-/tmp/out}
LOG=/tmp/run.log
STDLIB_ARGS=()
if [ -n "${STDLIB_TAR:-}" ]; then
  mkdir -p /tmp/stdlib && tar -xJf "$STDLIB_TAR" -C /tmp/stdlib && STDLIB_ARGS=(--stdlib-dir /tmp/stdlib)
fi
step() { echo "=== $*" | tee -a $LOG; }
step "default model"
python3 tools/train_default_model.py --out /tmp/dm "${STDLIB_ARGS[@]}" --max-epochs "${EPOCHS:-6}" \
  --time-budget-minutes "${DM_MINUTES:-3}" >> $LOG 2>&1 || step "default model failed"
DEST=atlas/assets/default-model
cp /tmp/dm/{config.json,model.safetensors,generation_config.json,tokenizer.json,tokenizer_config.json,expected_greedy.json,train_report.json} $DEST/
tail -3 $LOG
step "dflash drafter"
python3 tools/train_dflash_drafter.py --out /tmp/drafter "${STDLIB_ARGS[@]}" \
  --time-budget-minutes "${DRAFTER_MINUTES:-3}" >> $LOG 2>&1 || step "drafter failed"
mkdir -p $DEST/dflash-drafter && cp /tmp/drafter/{config.json,model.safetensors} $DEST/dflash-drafter/
tail -3 $LOG
mkdir -p /tmp/bench
step "bench spec"
python3 -m atlas.cli bench spec --methods ngram,dflash --concurrency 1,16 --gpu-memory-utilization 0.2 \
  --output-json /tmp/bench/spec_h200.json >> $LOG 2>&1 || step "bench spec failed"
step "bench decode"
python3 -m atlas.cli bench decode --concurrency 1,16,64 --gpu-memory-utilization 0.2 \
  --output-json /tmp/bench/decode_default_h200.json >> $LOG 2>&1 || step "bench decode failed"
cat /tmp/bench/*.txt | tee -a $LOG
tar -cf "$OUT/default-model.tar" -C /tmp/dm .
tar -cf "$OUT/dflash-drafter.tar" -C /tmp/drafter .
tar -cf "$OUT/bench.tar" -C /tmp/bench .
cp $LOG "$OUT/run.log"
