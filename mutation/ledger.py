"""The mutation ledger: mutmut's verdicts kept in the repository, so that a full run can
be spread over several sessions.

A full run of ``mutation/run.sh`` takes most of an hour here (7 minutes with
``mutmut run --max-children 16`` on 16 cores), and a sitting may end before it
does. mutmut keeps its verdicts in
``mutants/**/*.py.meta``, which git ignores, so an interrupted run is lost
with its machine. ``save`` merges every decided verdict, with mutmut's hash
of its function's source, into ``mutation/ledger.json``; ``restore`` writes
them back as meta files into an empty ``mutants/``, before mutmut generates
the mutants. mutmut then keeps a verdict only where the function's hash is
still the same (its own rule for a changed function), and ``mutmut run``
tests only the mutants without one.

What the hash does not see: the tests, and everything outside the function
itself (a module constant, a function it calls). ``restore`` warns when the
tests changed since the ledger's commit; a killed verdict stays as it was,
so after a test was weakened run from scratch (``mutation/run.sh`` without
``--continue``, which saves with ``--replace``). A change to mutmut's
configuration (``[tool.mutmut]``: the pytest arguments, the test selection,
the timeouts) makes ``restore`` refuse, as mutmut itself then re-tests
everything. Statuses that are not verdicts (a check interrupted by the user,
a worker killed) are not kept.

mutmut's hash is of the function's ``ast.dump``, which differs between Python
versions (3.12 added fields), and it is taken when mutmut generates the
mutants: every function of a ``mutants/`` generated under 3.12 looks changed
to mutmut under 3.11. The ledger records the Python version of its hashes
(``save --python`` names another than this one, e.g. for a ``mutants/``
generated on the GPU machine); ``restore`` under another version refuses, as
does a merging ``save`` across versions. ``save`` also refuses a meta file
whose hashes cannot be the named version's: none equal to this Python's hash
of the source while it names this version, or all of them while it names
another.

Usage, from the repository root::

    python mutation/ledger.py save [--replace] [--python X.Y]  # mutants/ -> the ledger
    python mutation/ledger.py restore                          # the ledger -> a new mutants/

Exit status: 0 done (or nothing to restore), 2 refused (the message says why).

Complexity: O(mutants), plus parsing the mutated sources once on ``save``. Thread
safety: a command; one at a time per checkout.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple, TypedDict

from mutmut.configuration import config
from mutmut.mutation.file_mutation import compute_function_hashes
from mutmut.stats import status_by_exit_code
from mutmut.utils.format_utils import mangled_name_from_mutant_name

from veloxquant_mlx.commandline.bad_input import OneLineParser

LEDGER = Path("mutation/ledger.json")
MUTANTS = Path("mutants")
FORMAT = 3
_SEPARATOR = "__mutmut_"
#: Statuses that say how a check ended, not what the tests said of the mutant.
NOT_VERDICTS = frozenset({"check was interrupted by user", "segfault"})
_UTF8 = "utf-8"  # method names hold "ǁ"


class FunctionVerdicts(TypedDict):
    """One mutated function: mutmut's hash of its source, and exit code by mutant number."""

    hash: str
    exit_codes: dict[str, int]


class FileVerdicts(TypedDict):
    """One mutated file: the module prefix of its mutant names, and its functions."""

    module: str
    functions: dict[str, FunctionVerdicts]


class Ledger(TypedDict):
    """The whole ledger: where it was saved, mutmut's configuration, and the verdicts.

    Invariant: every hash in ``files`` is of Python ``hash_python``'s ``ast.dump``.
    """

    format: int
    commit: str | None
    config_fingerprint: dict[str, str]
    hash_python: str  # the Python version whose ast.dump the hashes are of, e.g. "3.11"
    files: dict[str, FileVerdicts]


class MetaFile(TypedDict):
    """What this script reads of a mutmut meta file (``mutants/<source>.meta``)."""

    exit_code_by_key: dict[str, int | None]
    hash_by_function_name: dict[str, str]


class LedgerRefusedError(Exception):
    """A save or restore that would lose or misplace verdicts; its message says why."""


def verdicts_of_meta(meta: MetaFile) -> FileVerdicts:
    """The decided verdicts of one meta file (``None``: not tried yet)."""
    hashes = meta["hash_by_function_name"]
    record = FileVerdicts(module="", functions={})
    for key, code in meta["exit_code_by_key"].items():
        if code is None or status_by_exit_code[code] in NOT_VERDICTS:
            continue
        module, _, function = mangled_name_from_mutant_name(key).rpartition(".")
        number = key.rpartition(_SEPARATOR)[2]
        record["module"] = module
        entry = record["functions"].setdefault(
            function, FunctionVerdicts(hash=hashes[function], exit_codes={})
        )
        entry["exit_codes"][number] = code
    return record


def merged(old: FileVerdicts | None, new: FileVerdicts, hashes: Mapping[str, str]) -> FileVerdicts:
    """``new``'s verdicts over ``old``'s, for the functions ``hashes`` (the current meta
    file's) still has with the hash ``old`` recorded; a changed or gone function's are
    dropped."""
    functions: dict[str, FunctionVerdicts] = {}
    old_functions = old["functions"] if old is not None else {}
    for function, source_hash in hashes.items():
        codes: dict[str, int] = {}
        kept = old_functions.get(function)
        if kept is not None and kept["hash"] == source_hash:
            codes.update(kept["exit_codes"])
        if function in new["functions"]:
            codes.update(new["functions"][function]["exit_codes"])
        if codes:
            functions[function] = FunctionVerdicts(hash=source_hash, exit_codes=codes)
    module = new["module"] or (old["module"] if old is not None else "")
    return FileVerdicts(module=module, functions=functions)


def meta_files(mutants: Path, is_mutated: Callable[[str], bool]) -> Iterator[tuple[str, MetaFile]]:
    """Each meta file under ``mutants`` of a file ``is_mutated`` accepts, in path order,
    with its source's path (``mutants/a/b.py.meta`` is ``a/b.py``'s)."""
    for meta_path in sorted(mutants.rglob("*.py.meta")):
        source = str(meta_path.relative_to(mutants).with_suffix(""))
        if is_mutated(source):
            yield source, json.loads(meta_path.read_text(encoding=_UTF8))


def this_python() -> str:
    """This interpreter's version as the ledger records it, e.g. ``"3.11"``."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def updated_ledger(
    old: Ledger | None,
    mutants: Path,
    fingerprint: dict[str, str],
    is_mutated: Callable[[str], bool],
    hash_python: str,
) -> Ledger:
    """``old`` with the verdicts under ``mutants`` (hashed under Python ``hash_python``)
    merged in (``old`` may be ``None``).

    Only files that ``is_mutated`` accepts are kept. Raises:
        LedgerRefusedError: ``old`` was saved under another mutmut configuration, or
            its hashes are another Python version's (merging would drop every verdict).
    """
    if old is not None and old["config_fingerprint"] != fingerprint:
        raise LedgerRefusedError(
            f"{LEDGER} was saved under another [tool.mutmut] configuration, whose verdicts "
            "mutmut would not keep: save with --replace (after a run from scratch)"
        )
    if old is not None and old["hash_python"] != hash_python:
        raise LedgerRefusedError(
            f"{LEDGER}'s hashes are Python {old['hash_python']}'s and this save's Python "
            f"{hash_python}'s: merging would drop every verdict of the ledger. Name the "
            f"Python that generated {MUTANTS}/ with --python, or save with --replace "
            "after a run from scratch"
        )
    files = {
        source: record
        for source, record in (old["files"] if old is not None else {}).items()
        if is_mutated(source)
    }
    for source, meta in meta_files(mutants, is_mutated):
        new = verdicts_of_meta(meta)
        files[source] = merged(files.get(source), new, meta["hash_by_function_name"])
    files = {source: record for source, record in files.items() if record["functions"]}
    return Ledger(
        format=FORMAT,
        commit=None,
        config_fingerprint=fingerprint,
        hash_python=hash_python,
        files=files,
    )


class FileHashes(NamedTuple):
    """How one meta file's function hashes compare with this Python's hashes of the
    sources as they are now."""

    source: str
    compared: int
    equal: int


def compare_hashes(
    root: Path, mutants: Path, is_mutated: Callable[[str], bool]
) -> list[FileHashes]:
    """Per meta file under ``mutants`` whose source under ``root`` exists: how many
    function hashes were compared, and how many equal this Python's.

    A changed source changes some of a file's hashes; all of them differing means that
    its mutants were generated under another Python (``ast.dump`` differs), and all of
    them equal that they were generated under this one's version."""
    found = []
    for source, meta in meta_files(mutants, is_mutated):
        if not (root / source).is_file():
            continue  # a source gone since: its verdicts are dropped at the next restore
        here = compute_function_hashes((root / source).read_text(encoding=_UTF8))
        hashes = meta["hash_by_function_name"]
        equal = sum(here.get(function) == value for function, value in hashes.items())
        found.append(FileHashes(source, len(hashes), equal))
    return found


def require_hashes_of(hash_python: str, files: list[FileHashes]) -> None:
    """Refuse meta files that cannot be ``hash_python``'s: with this Python's version,
    a file whose every hash differs from this Python's; with another, a file whose every
    hash equals this Python's. Raises:
        LedgerRefusedError: Naming the first such file and its counts."""
    ours = hash_python == this_python()
    for file in files:
        if file.compared == 0 or (file.equal > 0 if ours else file.equal < file.compared):
            continue
        what = "none" if ours else "all"
        raise LedgerRefusedError(
            f"{what} of the {file.compared} function hashes of {MUTANTS}/{file.source}.meta "
            f"equal Python {this_python()}'s hash of the source, so its mutants were not "
            f"generated under Python {hash_python}: name the Python that generated "
            f"{MUTANTS}/ with --python X.Y (or, if the sources changed since, run again)"
        )


def write_meta_files(ledger: Ledger, mutants: Path, is_mutated: Callable[[str], bool]) -> int:
    """Write ``ledger``'s verdicts of mutated files as meta files under ``mutants``;
    return how many verdicts."""
    count = 0
    for source, record in ledger["files"].items():
        if not is_mutated(source):
            continue
        exit_codes: dict[str, int] = {}
        for function, entry in record["functions"].items():
            for number, code in entry["exit_codes"].items():
                exit_codes[f"{record['module']}.{function}{_SEPARATOR}{number}"] = code
        meta = {
            "exit_code_by_key": exit_codes,
            "hash_by_function_name": {f: e["hash"] for f, e in record["functions"].items()},
            "type_check_error_by_key": {},
            "durations_by_key": {},
            "estimated_durations_by_key": {},
        }
        meta_path = mutants / f"{source}.meta"
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(meta, indent=1), encoding=_UTF8)
        count += len(exit_codes)
    return count


def read_ledger(path: Path) -> Ledger:
    """The ledger at ``path``. Raises:
    LedgerRefusedError: It is not a ledger of this format."""
    try:
        ledger: Ledger = json.loads(path.read_text(encoding=_UTF8))
        found = ledger.get("format")
    except (ValueError, AttributeError) as error:
        raise LedgerRefusedError(
            f"{path} is not a ledger (JSON object) this script reads: {error}"
        ) from None
    if found != FORMAT:
        raise LedgerRefusedError(
            f"{path} has format {found!r}; expected {FORMAT} (written by this script's save): "
            "run from scratch (mutation/run.sh), whose save --replace writes this format"
        )
    return ledger


def ledger_text(ledger: Ledger) -> str:
    """``ledger`` as JSON with one line per function (mutants in number order), so a
    later save's diff shows which functions' verdicts changed."""
    head = {key: value for key, value in ledger.items() if key != "files"}
    lines = ["{"] + [f" {json.dumps(key)}: {json.dumps(value)}," for key, value in head.items()]
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


def count_verdicts(ledger: Ledger) -> int:
    """How many mutants ``ledger`` has a verdict for."""
    return sum(
        len(entry["exit_codes"])
        for record in ledger["files"].values()
        for entry in record["functions"].values()
    )


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], check=False, capture_output=True, text=True)


def _commit() -> str | None:
    """HEAD, with ``+changes`` when the tests or the mutated code differ from it."""
    head = _git("rev-parse", "HEAD")
    if head.returncode != 0:
        return None
    dirty = _git("diff", "--quiet", "HEAD", "--", "tests", "spec", "veloxquant_mlx")
    return head.stdout.strip() + ("+changes" if dirty.returncode == 1 else "")


def _save(replace: bool, hash_python: str) -> int:
    settings = config()
    require_hashes_of(hash_python, compare_hashes(Path("."), MUTANTS, settings.should_mutate))
    old = None if replace or not LEDGER.exists() else read_ledger(LEDGER)
    ledger = updated_ledger(
        old, MUTANTS, settings.config_fingerprint(), settings.should_mutate, hash_python
    )
    if not ledger["files"]:
        raise LedgerRefusedError(
            f"no decided mutant under {MUTANTS}/ nor in {LEDGER}; nothing saved"
        )
    ledger["commit"] = _commit()
    LEDGER.write_text(ledger_text(ledger), encoding=_UTF8)
    how = "those under mutants/ only" if old is None else "mutants/ merged into the ledger"
    print(f"{LEDGER}: {count_verdicts(ledger)} verdicts saved ({how})")
    return 0


def _restore() -> int:
    if MUTANTS.exists():
        raise LedgerRefusedError(
            f"{MUTANTS}/ exists; expected none (mutmut checks a verdict's function hash "
            "only while it generates the mutants): remove it first"
        )
    if not LEDGER.exists():
        print(f"no {LEDGER}: nothing to restore")
        return 0
    settings = config()
    ledger = read_ledger(LEDGER)
    if ledger["config_fingerprint"] != settings.config_fingerprint():
        raise LedgerRefusedError(
            f"{LEDGER} was saved under another [tool.mutmut] configuration; mutmut would "
            "re-test every mutant: run from scratch (mutation/run.sh)"
        )
    if ledger["hash_python"] != this_python():
        raise LedgerRefusedError(
            f"{LEDGER}'s hashes are Python {ledger['hash_python']}'s, and mutmut under "
            f"{this_python()} would re-test every mutant: continue under Python "
            f"{ledger['hash_python']}, or run from scratch (mutation/run.sh)"
        )
    _warn_if_tests_changed(ledger["commit"])
    count = write_meta_files(ledger, MUTANTS, settings.should_mutate)
    print(f"{LEDGER}: {count} verdicts restored into {MUTANTS}/ (kept where unchanged)")
    return 0


def _warn_if_tests_changed(commit: str | None) -> None:
    if commit is None:
        return
    changed = _git("diff", "--quiet", commit.removesuffix("+changes"), "--", "tests")
    if changed.returncode == 1 or commit.endswith("+changes"):
        print(
            f"note: tests/ changed since the ledger's commit {commit}; its killed verdicts "
            "stand (run from scratch if a test got weaker)"
        )


def python_version(text: str) -> str:
    """``--python``'s value as :func:`this_python` writes it (``03.012`` -> ``3.12``)."""
    if re.fullmatch(r"[0-9]+\.[0-9]+", text) is None:
        raise argparse.ArgumentTypeError(f"expected a Python version such as 3.12, got {text!r}")
    major, minor = text.split(".")
    return f"{int(major)}.{int(minor)}"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("save", "restore"))
    parser.add_argument(
        "--replace",
        action="store_true",
        help="save: write only the verdicts under mutants/ (after a run from scratch)",
    )
    parser.add_argument(
        "--python",
        type=python_version,
        metavar="X.Y",
        help="save: the Python version under which mutmut generated mutants/ (it hashes "
        f"the functions then), if not this one ({this_python()}); e.g. 3.12 for "
        "mutants/ generated on the GPU machine",
    )
    args = parser.parse_args(argv)
    if args.action == "restore" and (args.python is not None or args.replace):
        parser.error("restore takes no --python nor --replace (they are save's)")
    try:
        if args.action == "save":
            return _save(args.replace, args.python or this_python())
        return _restore()
    except LedgerRefusedError as refusal:
        print(f"ledger.py {args.action}: {refusal}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
