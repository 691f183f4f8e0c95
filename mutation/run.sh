#!/usr/bin/env bash
# Mutation testing of the block pool allocator and its executable spec: the one command.
#
#   mutation/run.sh              fresh run of every mutant, then the score (exit 1 below 95%)
#   mutation/run.sh --resume     continue an interrupted run, keeping mutants/
#   mutation/run.sh --continue   a new mutants/ from mutation/ledger.json's verdicts (those
#                                of unchanged functions), then the mutants without one
#   mutation/run.sh NAME...      re-test the named mutants (globs allowed), keeping mutants/
#
# At the end, finished or stopped by Ctrl-C, every mode merges the verdicts into
# mutation/ledger.json (the run from scratch replaces them); after a SIGKILL, run
# `python mutation/ledger.py save` by hand. A run that leaves mutants unchecked exits 3
# (inconclusive), never 0; one whose ledger could not be saved exits 4 (the message
# says why), and --continue whose ledger cannot be restored exits 2 and runs nothing.
#
# Configuration lives in pyproject.toml [tool.mutmut]; see mutation/README.md.
# Environment: MUTATION_WORKERS (default 2), MUTATION_MIN_SCORE (default 95).
set -euo pipefail

cd "$(dirname "$0")/.."
if [[ -x .venv/bin/mutmut ]]; then
    bin=.venv/bin
else
    bin="$(dirname "$(command -v mutmut)")"
fi

# Derandomised, unshrunk Hypothesis runs: every mutant sees the same examples.
export VELOXQUANT_HYPOTHESIS_PROFILE=mutation

ledger_args=()
case "${1:-}" in
    "") rm -rf mutants; args=(); ledger_args=(--replace) ;;
    --resume) args=() ;;
    --continue)
        # mutants/ goes only once the ledger is restored: a refusal leaves it as it was.
        rm -rf mutants.previous
        if [[ -e mutants ]]; then mv mutants mutants.previous; fi
        if ! "$bin/python" mutation/ledger.py restore; then
            rm -rf mutants
            if [[ -e mutants.previous ]]; then mv mutants.previous mutants; fi
            echo "run.sh: nothing run; mutants/ is as it was" >&2
            exit 2
        fi
        rm -rf mutants.previous
        args=() ;;
    *) args=("$@") ;;
esac

# mutmut redraws a spinner line with carriage returns; in a log keep only real lines.
if [[ -t 1 ]]; then
    show_progress() { cat; }
else
    show_progress() { tr '\r' '\n' | grep -v '^[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏] ' || true; }
fi

# A refused save is said, and turns a run that would exit 0 into exit 4; a failure's own
# status stays.
save_ledger() {
    local status=$?
    if ! "$bin/python" mutation/ledger.py save ${ledger_args[@]+"${ledger_args[@]}"}; then
        echo "run.sh: the ledger was not saved; this run's verdicts are only in mutants/" >&2
        if ((status == 0)); then exit 4; fi
    fi
}
trap save_ledger EXIT

start=$SECONDS
"$bin/mutmut" run --max-children "${MUTATION_WORKERS:-2}" ${args[@]+"${args[@]}"} | show_progress
echo "mutmut run took $(( (SECONDS - start) / 60 ))m $(( (SECONDS - start) % 60 ))s"
"$bin/python" mutation/score.py --min-score "${MUTATION_MIN_SCORE:-95}"
