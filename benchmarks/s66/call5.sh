#!/usr/bin/env bash
# Session 66 call 5 (written without a GPU: no machine was lent; for a later session; ~7 min; carry [".whl", ".s31"]):
# issue 38's bar on the shipped model ("the best of n-gram / DFlash at concurrency 1 and 16 no worse than today's
# 2.81x / 2.00x") is a ratio to plain decoding, and plain decoding of this small, host-bound model got faster since
# session 31 measured those ratios (plain 1,694 tok/s at one request then; 1,822-3,110 in session 59's runs), which
# lowers every ratio without speculation getting slower. This call runs session 31's commands on session 31's tree
# (36d50c2, the commit before BENCHMARKS recorded that run; `.s31/`, built here by `rm -rf .s31 && mkdir .s31 &&
# git archive 36d50c2 atlas pyproject.toml | tar x -C .s31 && find .s31 -name "*.safetensors" -delete`; the shipped
# model and drafter are unchanged since, and both trees read this checkout's) and on this tree, in one call: tok/s
# of plain, n-gram and DFlash, each tree against its own plain decoding, so the two trees' speculative tok/s can be
# set side by side as well as their ratios.
mkdir -p $OUT
export PYTHONUNBUFFERED=1
MODEL=$PWD/atlas/assets/default-model
source tools/device_site.sh  # (the wheels: this tree's engine needs msgspec)
BASE=$PYTHONPATH
spec() {  # TREE NAME ARGS...: atlas bench spec of that tree's sources
  local tree=$1 name=$2; shift 2
  (cd $tree && PYTHONPATH=$PWD${BASE:+:$BASE} timeout 200 python3 -m atlas.cli bench spec --model $MODEL \
    --methods ngram,dflash --gpu-memory-utilization 0.1 --repeats 3 --interleave "$@" \
    --output-json $OUT/$name.json > $OUT/$name.log 2>&1)
  echo "$name: exit $?"; grep -E "^(plain|ngram|dflash) " $OUT/$name.txt 2>/dev/null | cut -c1-150
}
for tree in .s31 .; do
  name=$([ $tree = . ] && echo now || echo s31)
  spec $tree ${name}_waves --waves 16 --concurrency 16,1 --schedule waves
  spec $tree ${name}_cont --waves 16 --concurrency 16 --schedule continuous
done
tar -czf /tmp/c.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/c.tgz $OUT/call5.tgz
