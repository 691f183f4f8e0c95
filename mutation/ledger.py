"""The mutation ledger: mutmut's verdicts kept in the repository, so that a full run can
be spread over several sessions.

A full run of ``mutation/run.sh`` takes hours here and about 110 minutes on 16
cores, more than one sitting of either. mutmut keeps its verdicts in
``mutants/**/*.py.meta``, which git ignores, so an interrupted run is lost
with its machine. ``save`` copies every decided verdict, with mutmut's hash
of each mutated function's source, into ``mutation/ledger.json``;
``restore`` writes them back as meta files into an empty ``mutants/``,
before mutmut generates the mutants. mutmut then keeps a verdict only where
the function's hash is still the same (its own rule for a changed function),
so a verdict never outlives the code it was found on, and ``mutmut run``
tests only the mutants without one.

What the hash does not see: a change to the tests, or to a function that a
mutated function calls. A killed mutant's verdict stays as it was; a test
change that weakens a test is the case to run from scratch for
(``mutation/run.sh`` without ``--continue``).

Usage, from the repository root::

    python mutation/ledger.py save       # mutants/ -> mutation/ledger.json
    python mutation/ledger.py restore    # mutation/ledger.json -> an empty mutants/

Complexity: O(mutants). Thread safety: a command; one at a time per checkout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

LEDGER = Path("mutation/ledger.json")
MUTANTS = Path("mutants")
FORMAT = 1
_SEPARATOR = "__mutmut_"


def ledger_of(mutants: Path) -> dict[str, Any]:
    """The decided verdicts under ``mutants``, per mutated file and function.

    ``{"format": 1, "files": {path: {"module": m, "functions": {f: {"hash": h,
    "exit_codes": {n: code}}}}}}``, where mutant ``n`` of function ``f`` is
    mutmut's ``{m}.{f}__mutmut_{n}``. A function with no decided mutant is left out.
    """
    files: dict[str, Any] = {}
    for meta_path in sorted(mutants.rglob("*.py.meta")):
        meta = json.loads(meta_path.read_text())
        hashes: dict[str, str] = meta["hash_by_function_name"]
        module = ""
        functions: dict[str, Any] = {}
        for key, code in meta["exit_code_by_key"].items():
            if code is None:
                continue
            mangled, number = key.rsplit(_SEPARATOR, 1)
            module, _, function = mangled.rpartition(".")
            entry = functions.setdefault(function, {"hash": hashes[function], "exit_codes": {}})
            entry["exit_codes"][number] = code
        if functions:
            source = str(meta_path.relative_to(mutants).with_suffix(""))
            files[source] = {"module": module, "functions": functions}
    return {"format": FORMAT, "commit": _head(), "files": files}


def write_meta_files(ledger: dict[str, Any], mutants: Path) -> int:
    """Write ``ledger``'s verdicts as mutmut meta files under ``mutants``; return how many.

    Raises:
        ValueError: ``ledger`` is not of this format.
    """
    if ledger.get("format") != FORMAT:
        raise ValueError(
            f"{LEDGER} has format {ledger.get('format')!r}; expected {FORMAT} "
            "(written by this script's save)"
        )
    count = 0
    for source, record in ledger["files"].items():
        exit_codes: dict[str, int] = {}
        hashes: dict[str, str] = {}
        for function, entry in record["functions"].items():
            hashes[function] = entry["hash"]
            for number, code in entry["exit_codes"].items():
                exit_codes[f"{record['module']}.{function}{_SEPARATOR}{number}"] = code
        meta_path = mutants / f"{source}.meta"
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "exit_code_by_key": exit_codes,
            "hash_by_function_name": hashes,
            "type_check_error_by_key": {},
            "durations_by_key": {},
            "estimated_durations_by_key": {},
        }
        meta_path.write_text(json.dumps(meta, indent=1))
        count += len(exit_codes)
    return count


def ledger_text(ledger: dict[str, Any]) -> str:
    """``ledger`` as JSON with one line per function (mutants in number order), so a
    later save's diff shows which functions' verdicts changed."""
    lines = ["{", f' "format": {ledger["format"]},', f' "commit": {json.dumps(ledger["commit"])},']
    lines.append(' "files": {')
    files = sorted(ledger["files"].items())
    for file_index, (source, record) in enumerate(files):
        lines.append(f"  {json.dumps(source)}: {{")
        lines.append(f'   "module": {json.dumps(record["module"])},')
        lines.append('   "functions": {')
        functions = sorted(record["functions"].items())
        for index, (function, entry) in enumerate(functions):
            codes = sorted(entry["exit_codes"].items(), key=lambda item: int(item[0]))
            line = json.dumps({"hash": entry["hash"], "exit_codes": dict(codes)})
            comma = "," if index < len(functions) - 1 else ""
            lines.append(f"    {json.dumps(function, ensure_ascii=False)}: {line}{comma}")
        lines.append("   }")
        lines.append("  }" + ("," if file_index < len(files) - 1 else ""))
    lines.extend([" }", "}"])
    return "\n".join(lines) + "\n"


def _head() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def _save() -> int:
    ledger = ledger_of(MUTANTS)
    if not ledger["files"]:
        print(f"no decided mutant under {MUTANTS}/; {LEDGER} left as it was", file=sys.stderr)
        return 2
    LEDGER.write_text(ledger_text(ledger))
    n = sum(
        len(entry["exit_codes"])
        for record in ledger["files"].values()
        for entry in record["functions"].values()
    )
    print(f"{LEDGER}: {n} verdicts saved")
    return 0


def _restore() -> int:
    if MUTANTS.exists():
        print(
            f"{MUTANTS}/ exists; expected none (mutmut checks a verdict's function hash "
            "only while it generates the mutants): remove it first",
            file=sys.stderr,
        )
        return 2
    if not LEDGER.exists():
        print(f"no {LEDGER}: nothing to restore", file=sys.stderr)
        return 0
    try:
        count = write_meta_files(json.loads(LEDGER.read_text()), MUTANTS)
    except (ValueError, KeyError, AttributeError) as error:
        print(f"{LEDGER} is not a ledger this script reads: {error}", file=sys.stderr)
        return 2
    print(f"{LEDGER}: {count} verdicts restored into {MUTANTS}/ (kept where unchanged)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("save", "restore"))
    args = parser.parse_args(argv)
    return _save() if args.action == "save" else _restore()


if __name__ == "__main__":
    sys.exit(main())
