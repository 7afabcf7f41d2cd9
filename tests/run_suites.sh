#!/usr/bin/env bash
# Run each test folder in its own pytest process. vLLM's in-process engines keep global state (its
# distributed environment, the current config), so engines created by one package's tests must not
# share a process with another package's. Prints every suite's summary with its 5 slowest tests, the wall time
# and CPU time of each folder and a combined closing line.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
status=0
passed=0
failed=0
skipped=0
walls=""
suite_start=$(date +%s)
for dir in tests/*/; do
  name=$(basename "$dir")
  [ "$name" = "__pycache__" ] && continue
  echo "=== tests/$name"
  out=$(mktemp)
  started=$(date +%s)
  cpu=$(mktemp)
  # CPU seconds (user + system, the folder's processes and their children) beside the wall time: a folder that
  # mostly waits uses far less CPU than wall time.
  if [ -x /usr/bin/time ]; then
    /usr/bin/time -f "%U %S" -o "$cpu" "$PY" -m pytest "$dir" --durations=5 "$@" 2>&1 | tee "$out"
  else
    "$PY" -m pytest "$dir" --durations=5 "$@" 2>&1 | tee "$out"
  fi
  rc=${PIPESTATUS[0]}
  cpu_s=$(awk 'NF == 2 { printf "%d", $1 + $2 }' "$cpu" 2>/dev/null)
  walls="$walls tests/$name $(( $(date +%s) - started ))s${cpu_s:+ (cpu ${cpu_s}s)};"
  rm -f "$cpu"
  # Exit code 5 means the folder had no selected test (e.g. only slow ones): not a failure.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=1; echo "=== tests/$name FAILED (exit $rc)"; fi
  line=$(grep -E "^=+ .*(passed|failed|error|skipped|deselected).* in [0-9.]+s" "$out" | tail -1)
  for kind in passed failed skipped; do
    n=$(echo "$line" | grep -oE "[0-9]+ $kind" | grep -oE "[0-9]+" || true)
    eval "$kind=\$(( $kind + ${n:-0} ))"
  done
  errors=$(echo "$line" | grep -oE "[0-9]+ error" | grep -oE "[0-9]+" || true)
  failed=$(( failed + ${errors:-0} ))
  rm -f "$out"
done
echo "wall time per folder:$walls"
echo "suites: $passed passed, $failed failed, $skipped skipped in $(( $(date +%s) - suite_start ))s"
exit $status
