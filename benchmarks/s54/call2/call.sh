#!/usr/bin/env bash
# Prepared in session 53: issue 42's figure at 64k context (BENCHMARKS.md 13 has 2k and 16k from session 53 call 2:
# DSA 4.90 / 5.06 ms a step in CUDA graphs per context bound, the dense-MLA twin 3.76 / 4.21 ms). At 64k the
# indexer's top-k runs over a bound of 65,536 (the doublings of index_topk up to the page table's width) while dense
# MLA reads every cached row: where DSA's decode cost should fall below the dense twin's.
mkdir -p $OUT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=$OUT CONTEXTS="65536" timeout 540 bash tools/gpu_dsa.sh > $OUT/gpu_dsa.log 2>&1
echo "exit $?" >> $OUT/gpu_dsa.log
grep -E "^== |exit" $OUT/gpu_dsa.log
for f in $OUT/dsa_*.txt; do echo "== $f"; tail -n 1 $f; done
tar -czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/  # (a call brings back few files)
