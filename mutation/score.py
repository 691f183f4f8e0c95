"""Print the mutation score of the last mutmut run, per file, and check it.

Reads mutmut's per-file results (``mutants/**/*.py.meta``) and prints, for
every mutated file, how many mutants were killed out of how many, then the
total. A mutant counts as killed when a test failed (``killed``) or the
tests stopped finishing (``timeout``: the mutant made them hang).

Exit status:

- 0: every mutant checked, the score at least ``--min-score``, and every
  mutant not killed listed in ``mutation/SURVIVORS.md`` (explained there as
  equivalent, or killed since by a new test);
- 1: a mutant not killed is missing from ``SURVIVORS.md``, or the score is
  below ``--min-score`` (with mutants unchecked: even if all of them were
  killed); this comes before 3;
- 2: no results under ``mutants/``;
- 3: inconclusive, never a pass: mutants are left unchecked (an interrupted
  run, or one spread over sessions through ``mutation/ledger.py``); the score
  of those checked so far is printed.

Usage: ``python mutation/score.py [--min-score 95]`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

MUTANTS = Path("mutants")
SURVIVORS_FILE = Path("mutation/SURVIVORS.md")
DETECTED = ("killed", "timeout")


def results_by_file() -> dict[str, dict[str, str]]:
    """Mutated file (repository path) -> {mutant name: status}, for files with mutants."""
    results: dict[str, dict[str, str]] = {}
    for meta_path in sorted(MUTANTS.rglob("*.py.meta")):
        exit_codes = json.loads(meta_path.read_text())["exit_code_by_key"]
        if exit_codes:
            source = meta_path.relative_to(MUTANTS).with_suffix("")
            results[str(source)] = {
                name: status_by_exit_code[code] for name, code in exit_codes.items()
            }
    return results


def print_table(results: dict[str, dict[str, str]]) -> tuple[int, int]:
    """Print one line per file and a total; return (detected, total)."""
    total_counts: Counter[str] = Counter()
    width = max(len(path) for path in results)
    for path, statuses in results.items():
        counts = Counter(statuses.values())
        total_counts.update(counts)
        print(_line(path.ljust(width), counts))
    print(_line("total".ljust(width), total_counts))
    return sum(total_counts[status] for status in DETECTED), sum(total_counts.values())


def _line(label: str, counts: Counter[str]) -> str:
    detected = sum(counts[status] for status in DETECTED)
    total = sum(counts.values())
    others = ", ".join(
        f"{counts[status]} {status}" for status in sorted(counts) if status not in DETECTED
    )
    score = 100.0 * detected / total if total else 100.0
    line = f"{label}  {detected:>5}/{total:<5} killed  {score:6.2f}%"
    line += f"  ({counts['killed']} killed, {counts['timeout']} timeout"
    return line + (f"; {others})" if others else ")")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-score", type=float, default=95.0, help="percent (default 95)")
    args = parser.parse_args()

    results = results_by_file()
    if not results:
        print("no mutation results under mutants/; run mutation/run.sh first", file=sys.stderr)
        return 2
    detected, total = print_table(results)
    score = 100.0 * detected / total

    problems = []
    not_detected = {
        name: status
        for statuses in results.values()
        for name, status in statuses.items()
        if status not in DETECTED
    }
    unchecked = sorted(name for name, status in not_detected.items() if status == "not checked")
    documented = SURVIVORS_FILE.read_text() if SURVIVORS_FILE.exists() else ""
    undocumented = sorted(
        name
        for name, status in not_detected.items()
        if status != "not checked" and f"`{name}`" not in documented
    )
    for name in undocumented:
        print(f"  not in {SURVIVORS_FILE}: {name} ({not_detected[name]})")
    if undocumented:
        problems.append(f"{len(undocumented)} surviving mutants not listed in {SURVIVORS_FILE}")
    if unchecked:
        best = 100.0 * (detected + len(unchecked)) / total
        if best < args.min_score:
            problems.append(
                f"even with every unchecked mutant killed the score, {best:.2f}%, would be "
                f"below the target {args.min_score:.2f}%"
            )
        return _inconclusive(problems, detected, total - len(unchecked), len(unchecked))
    if score < args.min_score:
        problems.append(f"score {score:.2f}% is below the target {args.min_score:.2f}%")

    print(f"mutation score: {detected}/{total} = {score:.2f}% (target >= {args.min_score:g}%)")
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _inconclusive(problems: list[str], detected: int, checked: int, n_unchecked: int) -> int:
    """Report a run with unchecked mutants: exit 1 for another problem, else 3."""
    so_far = 100.0 * detected / checked if checked else 0.0
    print(
        f"mutation score so far: {detected}/{checked} checked = {so_far:.2f}%; "
        f"{n_unchecked} mutants not checked yet, so no verdict on the whole"
    )
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(
        f"INCONCLUSIVE: {n_unchecked} mutants not checked (mutation/run.sh --resume goes "
        "on with this mutants/, --continue from mutation/ledger.json)",
        file=sys.stderr,
    )
    return 3


if __name__ == "__main__":
    sys.exit(main())
