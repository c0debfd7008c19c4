# Helpers of the GPU scripts (sourced): log lines with the time since START, `sources_hash`, and `step`, which runs a
# command with its output in $RES/NAME.log, for at most CAP seconds and never past START + BUDGET_S
# (20 s are kept for packing the results). Needs START, BUDGET_S, RES and LOG; TAIL lines of each log
# are shown (default 25).

log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( START + BUDGET_S - $(date +%s) )); }
# step NAME CAP_SECONDS CMD...
step() {
  local name=$1 cap=$2; shift 2
  local t=$(( $(left) - 20 ))
  [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 10 ]; then log "$name: skipped, no time left"; return 0; fi
  log "$name: start (limit ${t}s)"
  timeout -k 10 "$t" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  log "$name: exit $rc$([ $rc = 124 ] && echo ' (timed out)')"
  tail -n "${TAIL:-25}" "$RES/$name.log" | sed 's/^/    /'
}

# The sources' hash: a copy on a GPU machine may carry stale git metadata, so this says what ran (the
# same function in a checkout gives the hash to compare with).
# (C collation: the GPU machine's locale sorts the names differently)
sources_hash() { echo "atlas sources sha1 $(find atlas -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)"; }
