#!/usr/bin/env bash
# Device call 5 (session 46): call 4 again after the scheduler shares a request's record between decode steps that
# bring the runner nothing new (Request.idle_record): batch-256 decode before the snapshot merge and now.
bash benchmarks/s46/call4/call.sh
