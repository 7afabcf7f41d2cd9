#!/usr/bin/env bash
# Run each test folder in its own pytest process. vLLM's in-process engines keep global state (its
# distributed environment, the current config), so engines created by one package's tests must not
# share a process with another package's. Prints every suite's summary with its 5 slowest tests, the wall time
# and CPU time of each folder and a combined closing line.
#
# Folders run in two lanes at once (SWARMRL_TEST_LANES=1: one after another). Most folders use well under one
# core on average: they wait on servers, engines, Ray actors and subprocesses (the CPU column below: on a fresh
# clone the whole suite used 1,127 CPU s in 923 s of wall time, shardcast 22 in 58, orchestrator 77 in 189).
# The first lane takes the whole-system runs and the folders that balance it; each folder's output is printed
# whole when it ends.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LANES=${SWARMRL_TEST_LANES:-2}
FIRST_LANE=" e2e trainer bench verifier "
ARGS=("$@")
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

run_folder() {
  local dir=$1 name rc started cpu_s
  name=$(basename "$dir")
  started=$(date +%s)
  # CPU seconds (user + system, the folder's processes and their children) beside the wall time.
  if [ -x /usr/bin/time ]; then
    /usr/bin/time -f "%U %S" -o "$logs/$name.cpu" "$PY" -m pytest "$dir" --durations=5 "${ARGS[@]}" \
      > "$logs/$name.log" 2>&1
  else
    "$PY" -m pytest "$dir" --durations=5 "${ARGS[@]}" > "$logs/$name.log" 2>&1
  fi
  rc=$?
  cpu_s=$(awk 'NF == 2 { printf "%d", $1 + $2 }' "$logs/$name.cpu" 2>/dev/null)
  echo "$rc $(( $(date +%s) - started )) ${cpu_s:-}" > "$logs/$name.result"
  {
    flock 9
    echo "=== tests/$name ($(( $(date +%s) - started )) s)"
    cat "$logs/$name.log"
  } 9> "$logs/print.lock"
}

lane() {
  for dir in "$@"; do run_folder "$dir"; done
}

folders=()
for dir in tests/*/; do
  [ "$(basename "$dir")" = "__pycache__" ] && continue
  folders+=("$dir")
done

suite_start=$(date +%s)
if [ "$LANES" -ge 2 ]; then
  first=() second=()
  for dir in "${folders[@]}"; do
    case "$FIRST_LANE" in *" $(basename "$dir") "*) first+=("$dir") ;; *) second+=("$dir") ;; esac
  done
  lane "${first[@]}" &
  lane "${second[@]}" &
  wait
else
  lane "${folders[@]}"
fi

status=0 passed=0 failed=0 skipped=0 walls=""
for dir in "${folders[@]}"; do
  name=$(basename "$dir")
  read -r rc wall cpu_s < "$logs/$name.result" || { rc=1 wall=0 cpu_s=""; }
  walls="$walls tests/$name ${wall}s${cpu_s:+ (cpu ${cpu_s}s)};"
  # Exit code 5 means the folder had no selected test (e.g. only slow ones): not a failure.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=1; echo "=== tests/$name FAILED (exit $rc)"; fi
  line=$(grep -E "^=+ .*(passed|failed|error|skipped|deselected).* in [0-9.]+s" "$logs/$name.log" | tail -1)
  for kind in passed failed skipped; do
    n=$(echo "$line" | grep -oE "[0-9]+ $kind" | grep -oE "[0-9]+" || true)
    eval "$kind=\$(( $kind + ${n:-0} ))"
  done
  errors=$(echo "$line" | grep -oE "[0-9]+ error" | grep -oE "[0-9]+" || true)
  failed=$(( failed + ${errors:-0} ))
done
echo "wall time per folder ($LANES lanes):$walls"
echo "suites: $passed passed, $failed failed, $skipped skipped in $(( $(date +%s) - suite_start ))s"
exit $status
