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
#   DURATION     seconds of calls per run (default: the profile's 600); each run then
#                has at most its checking budget (nightly: 120 s) to finish checking
#   STRESS_ARGS  extra options for every run (e.g. "--threads 16")
#   SOAK_SECONDS seconds of the decode-thread soak (default 600; 0 skips it): four
#                threads decoding through one MLX store (tests/test_decode_threads_soak.py)
#
# Every run ends with a verdict (report.json "verdict"); only OK passes. INCONCLUSIVE
# (not every call was checked) is a failure here, as is a violation or a run that did
# not start. Exit status: 0 if every run was OK; 1 if any found a violation or failed
# to run; 2 if REPORT_DIR was refused; otherwise 3 if any was inconclusive; 130 on
# Ctrl-C (the runs left stop there).
set -uo pipefail
cd "$(dirname "$0")/.."

force=0
if [[ ${1:-} == --force ]]; then
  force=1
  shift
fi
out=${1:-reports/nightly-$(date +%Y%m%d-%H%M%S)}
if [[ -e $out && ! -d $out ]]; then
  echo "nightly.sh: error: REPORT_DIR '$out' is a file; expected a folder" >&2
  exit 2
fi
# The night's verdicts outside the stress runs, one NAME.txt each: a section of SUMMARY.txt
# each, and cleared by --force with the rest of a night's top-level files.
sections=(decode-thread-soak ft-thread-tests free-threaded-skipped)
if [[ -d $out && -n $(ls -A "$out") ]]; then
  if ((!force)); then
    echo "nightly.sh: error: REPORT_DIR '$out' is not empty (an earlier night's reports?);" \
      "expected a new or empty folder, or --force to delete an earlier night's files" >&2
    exit 2
  fi
  # What a night writes at the top: its logs, SUMMARY.txt, the sections' files; the
  # runs' own folders are cleared by each run's --force (its files only).
  rm -f "$out"/*.log "$out/SUMMARY.txt"
  for section in "${sections[@]}"; do rm -f "$out/$section.txt"; done
fi
mkdir -p "$out"
PYTHON=${PYTHON:-.venv/bin/python}
DURATION=${DURATION:-}
read -r -a extra <<<"${STRESS_ARGS:-}"
((force)) && extra+=(--force)
violations=0 inconclusive=0
ran=()  # this night's runs, in order: the only ones SUMMARY.txt shows

# summarize: SUMMARY.txt on top of the folder, from this night's runs' summaries.
summarize() {
  local verdict=OK
  ((inconclusive)) && verdict="FAILED (inconclusive: not every call was checked)"
  ((violations)) && verdict="FAILED"
  {
    echo "nightly stress $(date -Iseconds): $verdict"
    for name in "${ran[@]}"; do
      echo
      echo "## $name"
      if [[ -e $out/$name/summary.txt ]]; then
        cat "$out/$name/summary.txt"
      else
        echo "(no summary: see $name.log)"
      fi
    done
    for section in "${sections[@]}"; do
      if [[ -e $out/$section.txt ]]; then
        echo
        echo "## $section"
        cat "$out/$section.txt"
      fi
    done
  } >"$out/SUMMARY.txt"
}

# run NAME INTERPRETER [OPTIONS...]: one nightly run into $out/NAME, its log in $out/NAME.log.
run() {
  local name=$1 python=$2
  shift 2
  local args=(--profile nightly --out "$out/$name" --no-progress "$@" "${extra[@]}")
  [[ -n $DURATION ]] && args+=(--duration "$DURATION")
  ran+=("$name")
  printf '== %s (%s) %s\n' "$name" "$python" "$(date +%H:%M:%S)"
  # PYTHONPATH lets an interpreter without the project installed import it from here.
  PYTHONPATH=".:spec${PYTHONPATH:+:$PYTHONPATH}" "$python" -m stress "${args[@]}" \
    >"$out/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) echo "   OK" ;;
    3) echo "   INCONCLUSIVE: not every call was checked (see $out/$name.log)"
       inconclusive=1 ;;
    130) echo "   INTERRUPTED: the remaining runs are skipped"
       summarize
       exit 130 ;;
    1) echo "   VIOLATION (see $out/$name.log)"
       violations=1 ;;
    *) echo "   FAILED to run: exit status $rc (see $out/$name.log)"
       violations=1 ;;
  esac
}

# The GIL build: separate K/V lists with growth, one shared list, and no growth.
run gil-separate-kv "$PYTHON" --seed 1
run gil-shared-kv "$PYTHON" --seed 2 --shared-kv
run gil-no-grow "$PYTHON" --seed 3 --no-grow

# The decode-thread soak: four mlx-lm threads on one MLX store, against KVCache. It
# guards the MLX race that mlx_storage.publish closes; a crash is a failed run (139: a
# segfault).
SOAK_SECONDS=${SOAK_SECONDS:-600}
if [[ $SOAK_SECONDS =~ ^[0-9]+$ ]] && ((10#$SOAK_SECONDS > 0)); then
  printf '== decode-thread-soak (%s s) %s\n' "$SOAK_SECONDS" "$(date +%H:%M:%S)"
  VELOXQUANT_SOAK_SECONDS=$SOAK_SECONDS "$PYTHON" -m pytest -q -s -p no:cacheprovider \
    tests/test_decode_threads_soak.py >"$out/decode-thread-soak.log" 2>&1
  status=$?
  if ((status == 2)); then  # pytest's status when interrupted: stop the night as run() does
    echo "   INTERRUPTED: the remaining runs are skipped"
    summarize
    exit 130
  elif ((status == 0)) && grep -q "1 passed" "$out/decode-thread-soak.log"; then
    echo "decode-thread-soak: OK" | tee "$out/decode-thread-soak.txt"
  else  # a failure, a crash (139: a segfault), or a soak that did not run
    echo "decode-thread-soak: FAILED, exit status $status (see decode-thread-soak.log)" \
      | tee "$out/decode-thread-soak.txt"
    violations=$((violations + 1))
  fi
elif [[ ! $SOAK_SECONDS =~ ^0+$ ]]; then
  echo "decode-thread-soak: FAILED, SOAK_SECONDS='$SOAK_SECONDS' is not a whole number" \
    "of seconds" | tee "$out/decode-thread-soak.txt"
  violations=$((violations + 1))
fi

# ---- free-threaded build ----------------------------------------------------------------
# Owned by the free-threaded work (issue 5, item 5): add its runs here. FT_PYTHON is
# the interpreter; it needs numpy and mlx (see shared/tools/build-freethreaded-python).
FT_PYTHON=${FT_PYTHON:-$HOME/.cache/ft-python/bin/python3}
if [[ -x $FT_PYTHON ]]; then
  run ft-separate-kv "$FT_PYTHON" --seed 1
  run ft-shared-kv "$FT_PYTHON" --seed 2 --shared-kv
  # The thread test files under the free-threaded interpreter (about 3 minutes, so
  # nightly rather than in the README's test command; tests/test_free_threaded.py).
  if VELOXQUANT_FT_SUITE=1 VELOXQUANT_FT_PYTHON="$FT_PYTHON" "$PYTHON" -m pytest -q \
      -p no:cacheprovider tests/test_free_threaded.py >"$out/ft-thread-tests.log" 2>&1; then
    echo "ft-thread-tests: OK" | tee "$out/ft-thread-tests.txt"
  else
    echo "ft-thread-tests: FAILED (see ft-thread-tests.log)" | tee "$out/ft-thread-tests.txt"
    violations=$((violations + 1))
  fi
else
  echo "no free-threaded interpreter at FT_PYTHON=$FT_PYTHON: free-threaded runs skipped" \
    | tee "$out/free-threaded-skipped.txt"
fi
# ---- end of the free-threaded section -----------------------------------------------------

summarize
echo "reports in $out (SUMMARY.txt)"
((violations)) && exit 1
((inconclusive)) && exit 3
exit 0
