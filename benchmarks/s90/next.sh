#!/usr/bin/env bash
# For the next session with an H200 (carry [".whl"]; ~6 min): issue 38's rows at 64 and 256 streams after this
# session's policy change (a request not measured yet counts at the recent mean once it has followed 32
# observations: a new wave among drafts never accepted is no longer probed at its start; replayed 0.975 -> 0.986x at
# 256 streams), DFlash with the random drafter then n-gram on random prompts, each interleaved with the plain engine
# (session 77's script); then `bash benchmarks/s90/call5.sh` in a call of its own (gemv=auto at batch 1).
FINAL=$OUT; mkdir -p /tmp/s90n
for part in dflash ngram; do
  mkdir -p /tmp/s90n/$part
  OUT=/tmp/s90n/$part PART=$part timeout 280 bash benchmarks/s77/next_policy_rows.sh 2>&1 | grep -E "^(method|plain|dflash|ngram)"
  tar czf $FINAL/s90_next.tgz -C /tmp s90n
done
echo "done at ${SECONDS}s"
