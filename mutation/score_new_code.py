"""Mutation score of the lines a change added: what an issue's "score on the new code" means.

A mutant belongs to the new code when the line it changes is one that
``git diff BASE...HEAD`` adds to a mutated file (a line the change only kept
does not count, even inside a function it touched). Reads mutmut's results
in ``mutants/`` (a run of ``mutation/run.sh``, whole or by name) and prints,
per function, how many of those mutants were killed out of how many were
tried, then the total and every mutant not killed. A timeout counts as
killed, as in ``score.py``; a mutant not tried yet is counted apart, never
as killed or survived.

Usage, from the repository root:

    python mutation/score_new_code.py --base main [--head HEAD] [--names]

``--names`` prints the new code's mutant names instead, one a line, to hand
to ``mutation/run.sh``. Exits non-zero when the score of the mutants tried
is below ``--min-score`` or when some are still untried.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from mutmut.stats import status_by_exit_code

MUTANTS = Path("mutants")
DETECTED = ("killed", "timeout")
MUTANT_SUFFIX = re.compile(r"__mutmut_(\d+|orig)$")
# The def line of a mutant's function, which names it: as the source spells it, after the sub.
MUTANT_DEF = re.compile(r"def x(?:ǁ\w+ǁ|_)(\w+?)__mutmut_(?:\d+|orig)\(")


@dataclass(frozen=True)
class Mutant:
    name: str
    function: str  # the mutant's name without __mutmut_N
    status: str  # mutmut's word, or "not checked"


def added_lines(path: str, base: str, head: str) -> set[int]:
    """Line numbers (in ``head``'s version of ``path``) that ``git diff base...head`` adds."""
    diff = subprocess.run(
        ["git", "diff", "-U0", f"{base}...{head}", "--", path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    added: set[int] = set()
    for hunk in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.MULTILINE):
        start, count = int(hunk.group(1)), int(hunk.group(2) or 1)
        added.update(range(start, start + count))
    return added


def function_spans(source: str) -> dict[str, range]:
    """mutmut's name of each function and method (``x_f``, ``xǁClassǁf``) -> its lines."""
    named: list[tuple[str, ast.stmt]] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            named.append((f"x_{node.name}", node))
        elif isinstance(node, ast.ClassDef):
            named += [
                (f"xǁ{node.name}ǁ{member.name}", member)
                for member in node.body
                if isinstance(member, ast.FunctionDef)
            ]
    return {name: range(node.lineno, (node.end_lineno or node.lineno) + 1) for name, node in named}


def mutated_text(mutant_lines: list[str], spans: dict[str, list[int]], key: str) -> list[str]:
    """The lines of the original function that mutant ``key`` removes or changes."""
    original_key = MUTANT_SUFFIX.sub("__mutmut_orig", key)

    def body(name: str) -> list[str]:
        start, end = spans[name]
        return [MUTANT_DEF.sub(r"def \1(", line) for line in mutant_lines[start - 1 : end]]

    diff = difflib.ndiff(body(original_key), body(key))
    return [line[2:] for line in diff if line.startswith("- ")]


def new_code_mutants(path: str, base: str, head: str) -> list[Mutant]:
    """The mutants of ``path`` whose changed line ``git diff base...head`` added."""
    meta = json.loads((MUTANTS / f"{path}.meta").read_text())["exit_code_by_key"]
    spans = json.loads((MUTANTS / f"{path}.spans").read_text())["spans"]
    mutant_lines = (MUTANTS / path).read_text().splitlines()
    source = Path(path).read_text()
    source_lines = source.splitlines()
    function_lines = function_spans(source)
    added = added_lines(path, base, head)
    module = path.removesuffix(".py").replace("/", ".")
    found = []
    for key, exit_code in meta.items():
        function = MUTANT_SUFFIX.sub("", key)
        lines = function_lines.get(function.removeprefix(module + "."), range(0))
        if not added.intersection(lines):
            continue  # a function the change did not touch
        removed = {text.strip() for text in mutated_text(mutant_lines, spans, key.split(".")[-1])}
        if any(source_lines[n - 1].strip() in removed for n in added.intersection(lines)):
            status = "not checked" if exit_code is None else status_by_exit_code[exit_code]
            found.append(Mutant(key, function, status))
    return found


def mutated_files() -> list[str]:
    return sorted(
        str(meta.relative_to(MUTANTS))[: -len(".meta")] for meta in MUTANTS.rglob("*.py.meta")
    )


def report(mutants: list[Mutant], min_score: float) -> int:
    by_function: dict[str, Counter[str]] = defaultdict(Counter)
    for mutant in mutants:
        by_function[mutant.function][mutant.status] += 1
    total: Counter[str] = Counter()
    for function, counts in sorted(by_function.items()):
        total.update(counts)
        print(_line(function, counts))
    print(_line("new code, total", total))
    for mutant in mutants:
        if mutant.status not in (*DETECTED, "not checked"):
            print(f"  {mutant.status}: {mutant.name}")
    detected = sum(total[status] for status in DETECTED)
    tried = sum(total.values()) - total["not checked"]
    score = 100.0 * detected / tried if tried else 0.0
    print(
        f"new-code mutation score: {detected}/{tried} tried = {score:.2f}% "
        f"({total['not checked']} of {sum(total.values())} not tried yet)"
    )
    return 0 if score >= min_score and not total["not checked"] else 1


def _line(label: str, counts: Counter[str]) -> str:
    detected = sum(counts[status] for status in DETECTED)
    tried = sum(counts.values()) - counts["not checked"]
    rest = ", ".join(
        f"{n} {status}" for status, n in sorted(counts.items()) if status not in DETECTED
    )
    return f"{label:90} {detected:>4}/{tried:<4} killed" + (f" ({rest})" if rest else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision the change started from")
    parser.add_argument("--head", default="HEAD", help="the change's revision (default HEAD)")
    parser.add_argument("--names", action="store_true", help="print the mutant names only")
    parser.add_argument("--min-score", type=float, default=95.0, help="percent (default 95)")
    args = parser.parse_args()
    if not MUTANTS.is_dir():
        print("no mutants/ here; run mutation/run.sh (or mutmut run) first", file=sys.stderr)
        return 2
    mutants = [m for path in mutated_files() for m in new_code_mutants(path, args.base, args.head)]
    if args.names:
        print("\n".join(mutant.name for mutant in mutants))
        return 0
    return report(mutants, args.min_score)


if __name__ == "__main__":
    sys.exit(main())
