#!/usr/bin/env bash
# Nightly stress: the nightly profile (8 threads, 10 minutes each) on several pool
# configurations, on the GIL build and, when one is present, on a free-threaded
# build; every run's folder (report.json, summary.txt, linearized.jsonl, any
# reproducer or stack dump) and log go into ONE folder, with SUMMARY.txt on top.
#
#   stress/nightly.sh [REPORT_DIR]      (default: reports/nightly-YYYYmmdd-HHMMSS)
#
# Environment:
#   PYTHON       the GIL interpreter (default: .venv/bin/python)
#   FT_PYTHON    a free-threaded interpreter (default: ~/.cache/ft-python/bin/python3,
#                as built by shared/tools/build-freethreaded-python); skipped if absent
#   DURATION     seconds per run (default: the profile's 600)
#   STRESS_ARGS  extra options for every run (e.g. "--threads 16")
#
# Exit status: 0 if every run passed, 1 if any found a violation (or failed to run).
set -uo pipefail
cd "$(dirname "$0")/.."

out=${1:-reports/nightly-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
PYTHON=${PYTHON:-.venv/bin/python}
DURATION=${DURATION:-}
read -r -a extra <<<"${STRESS_ARGS:-}"
status=0

# run NAME INTERPRETER [OPTIONS...]: one nightly run into $out/NAME, its log in $out/NAME.log.
run() {
  local name=$1 python=$2
  shift 2
  local args=(--profile nightly --out "$out/$name" --no-progress "$@" "${extra[@]}")
  [[ -n $DURATION ]] && args+=(--duration "$DURATION")
  printf '== %s (%s) %s\n' "$name" "$python" "$(date +%H:%M:%S)"
  # PYTHONPATH lets an interpreter without the project installed import it from here.
  if PYTHONPATH=".:spec${PYTHONPATH:+:$PYTHONPATH}" "$python" -m stress "${args[@]}" \
      >"$out/$name.log" 2>&1; then
    echo "   passed"
  else
    echo "   FAILED (see $out/$name.log)"
    status=1
  fi
}

# The GIL build: separate K/V lists with growth, one shared list, and no growth.
run gil-separate-kv "$PYTHON" --seed 1
run gil-shared-kv "$PYTHON" --seed 2 --shared-kv
run gil-no-grow "$PYTHON" --seed 3 --no-grow

# ---- free-threaded build ----------------------------------------------------------------
# Owned by the free-threaded work (issue 5, item 5): add its runs here. FT_PYTHON is
# the interpreter; it needs numpy and mlx (see shared/tools/build-freethreaded-python).
FT_PYTHON=${FT_PYTHON:-$HOME/.cache/ft-python/bin/python3}
if [[ -x $FT_PYTHON ]]; then
  run ft-separate-kv "$FT_PYTHON" --seed 1
  run ft-shared-kv "$FT_PYTHON" --seed 2 --shared-kv
else
  echo "no free-threaded interpreter at FT_PYTHON=$FT_PYTHON: free-threaded runs skipped" \
    | tee "$out/free-threaded-skipped.txt"
fi
# ---- end of the free-threaded section -----------------------------------------------------

{
  echo "nightly stress $(date -Iseconds): $([[ $status == 0 ]] && echo OK || echo FAILED)"
  for summary in "$out"/*/summary.txt; do
    [[ -e $summary ]] || continue
    echo
    echo "## $(basename "$(dirname "$summary")")"
    cat "$summary"
  done
} >"$out/SUMMARY.txt"
echo "reports in $out (SUMMARY.txt)"
exit $status
