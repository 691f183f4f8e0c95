"""mutation/ledger.py and mutation/score.py: verdicts kept across sessions, and what a
partial run reports."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import load_mutation_script
from mutmut.mutation.file_mutation import compute_function_hashes

MUTATION = Path(__file__).resolve().parent.parent / "mutation"


ledger_module = load_mutation_script("ledger")
score_module = load_mutation_script("score")

POOL = "veloxquant_mlx/memory/block_pool.py"
PREFIX = "veloxquant_mlx.memory.block_pool."
METHOD = "xǁBlockPoolAllocatorǁallocate"
FINGERPRINT = {"test_execution": "e", "test_selection": "s"}


def every_file(source: str) -> bool:
    return True


def write_meta(root: Path, exit_codes: dict[str, int | None], hashes: dict[str, str]) -> None:
    path = root / "mutants" / f"{POOL}.meta"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "exit_code_by_key": exit_codes,
        "hash_by_function_name": hashes,
        "type_check_error_by_key": {},
        "durations_by_key": {},
        "estimated_durations_by_key": {},
    }
    path.write_text(json.dumps(meta), encoding="utf-8")


def read_meta(root: Path) -> dict[str, object]:
    meta: dict[str, object] = json.loads((root / f"{POOL}.meta").read_text(encoding="utf-8"))
    return meta


def test_restored_meta_files_hold_exactly_the_verdicts_with_their_hashes(tmp_path: Path) -> None:
    codes: dict[str, int | None] = {
        f"{PREFIX}{METHOD}__mutmut_1": 1,  # killed
        f"{PREFIX}{METHOD}__mutmut_2": 0,  # survived
        f"{PREFIX}{METHOD}__mutmut_3": 2,  # interrupted by the user: not a verdict
        f"{PREFIX}{METHOD}__mutmut_10": None,
        f"{PREFIX}x__require_block_id__mutmut_3": 36,  # timeout
        f"{PREFIX}x_killed_worker__mutmut_1": -9,  # not a verdict either
    }
    hashes = {METHOD: "aaa", "x__require_block_id": "bbb", "x_killed_worker": "ccc"}
    write_meta(tmp_path, codes, hashes)
    ledger = ledger_module.updated_ledger(
        None, tmp_path / "mutants", FINGERPRINT, every_file, "3.11"
    )
    reread = json.loads(ledger_module.ledger_text(ledger))
    assert reread == ledger
    count = ledger_module.write_meta_files(reread, tmp_path / "restored", every_file)
    restored = read_meta(tmp_path / "restored")
    assert count == 3
    assert restored["exit_code_by_key"] == {
        f"{PREFIX}{METHOD}__mutmut_1": 1,
        f"{PREFIX}{METHOD}__mutmut_2": 0,
        f"{PREFIX}x__require_block_id__mutmut_3": 36,
    }
    assert restored["hash_by_function_name"] == {METHOD: "aaa", "x__require_block_id": "bbb"}


def test_a_save_keeps_the_ledgers_verdicts_of_unchanged_functions_and_drops_the_others(
    tmp_path: Path,
) -> None:
    first = {f"{PREFIX}{METHOD}__mutmut_1": 1, f"{PREFIX}x_changed__mutmut_1": 1}
    write_meta(
        tmp_path,
        {**first, f"{PREFIX}{METHOD}__mutmut_2": None},
        {METHOD: "aaa", "x_changed": "old"},
    )
    old = ledger_module.updated_ledger(None, tmp_path / "mutants", FINGERPRINT, every_file, "3.11")
    # A later session ran one more mutant of the unchanged method; x_changed's source changed.
    later = {f"{PREFIX}{METHOD}__mutmut_1": None, f"{PREFIX}{METHOD}__mutmut_2": 0}
    write_meta(
        tmp_path,
        {**later, f"{PREFIX}x_changed__mutmut_1": None},
        {METHOD: "aaa", "x_changed": "new"},
    )
    ledger = ledger_module.updated_ledger(
        old, tmp_path / "mutants", FINGERPRINT, every_file, "3.11"
    )
    functions = ledger["files"][POOL]["functions"]
    assert functions == {METHOD: {"hash": "aaa", "exit_codes": {"1": 1, "2": 0}}}


def test_a_ledger_of_another_configuration_or_format_is_refused_by_name(tmp_path: Path) -> None:
    write_meta(tmp_path, {f"{PREFIX}{METHOD}__mutmut_1": 1}, {METHOD: "aaa"})
    old = ledger_module.updated_ledger(None, tmp_path / "mutants", FINGERPRINT, every_file, "3.11")
    with pytest.raises(ledger_module.LedgerRefusedError, match="saved under another"):
        ledger_module.updated_ledger(old, tmp_path / "mutants", {"other": "x"}, every_file, "3.11")
    (tmp_path / "ledger.json").write_text('{"format": 1, "files": {}}', encoding="utf-8")
    with pytest.raises(ledger_module.LedgerRefusedError, match="has format 1; expected 3"):
        ledger_module.read_ledger(tmp_path / "ledger.json")


def test_a_merge_of_hashes_of_another_python_version_is_refused_by_name(tmp_path: Path) -> None:
    write_meta(tmp_path, {f"{PREFIX}{METHOD}__mutmut_1": 1}, {METHOD: "aaa"})
    old = ledger_module.updated_ledger(None, tmp_path / "mutants", FINGERPRINT, every_file, "3.12")
    assert old["hash_python"] == "3.12"
    with pytest.raises(
        ledger_module.LedgerRefusedError, match=r"Python 3\.12's and this save's Python 3\.11's"
    ):
        ledger_module.updated_ledger(old, tmp_path / "mutants", FINGERPRINT, every_file, "3.11")


SOURCE = "def f(x):\n    return x + 1\n\n\ndef g(x):\n    return x - 1\n"
THIS = "this"  # a hash as this Python computes it from SOURCE
OTHER = "0" * 12  # a hash this Python never computes from SOURCE


def project_with_meta(root: Path, kinds: dict[str, str], *, with_source: bool = True) -> None:
    """A scratch project: this pyproject, SOURCE as the allocator's file, and a meta file
    of one killed mutant per function, whose hashes are this Python's or not."""
    (root / "pyproject.toml").write_text(
        (MUTATION.parent / "pyproject.toml").read_text(encoding="utf-8"), encoding="utf-8"
    )
    if with_source:
        (root / POOL).parent.mkdir(parents=True, exist_ok=True)
        (root / POOL).write_text(SOURCE, encoding="utf-8")
    here = compute_function_hashes(SOURCE)
    hashes = {name: here[name] if kind == THIS else OTHER for name, kind in kinds.items()}
    write_meta(root, {f"{PREFIX}{name}__mutmut_1": 1 for name in kinds}, hashes)


def saved(root: Path) -> dict[str, object]:
    ledger: dict[str, object] = json.loads((root / "mutation" / "ledger.json").read_text())
    return ledger


#: The meta file's hashes (this Python's or not), save's options, and the refusal if any.
SaveCase = tuple[dict[str, str], list[str], str | None]


@pytest.mark.parametrize(
    "case",
    [
        ({"x_f": THIS, "x_g": THIS}, [], None),
        ({"x_f": THIS, "x_g": OTHER}, [], None),  # g changed since mutants/ was made
        ({"x_f": OTHER, "x_g": OTHER}, [], "none of the 2 function hashes"),
        ({"x_f": OTHER, "x_g": OTHER}, ["--python", "3.12"], None),
        ({"x_f": THIS, "x_g": OTHER}, ["--python", "3.12"], None),
        ({"x_f": THIS, "x_g": THIS}, ["--python", "3.12"], "all of the 2 function hashes"),
    ],
)
def test_save_records_the_python_of_the_hashes_and_refuses_meta_files_of_another(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    case: SaveCase,
) -> None:
    kinds, argv, refusal = case
    project_with_meta(tmp_path, kinds)
    (tmp_path / "mutation").mkdir()
    monkeypatch.chdir(tmp_path)
    status = ledger_module.main(["save", "--replace", *argv])
    if refusal is None:
        assert status == 0
        expected = argv[1] if argv else ledger_module.this_python()
        assert saved(tmp_path)["hash_python"] == expected
    else:
        assert status == 2
        error = capsys.readouterr().err
        assert f"{refusal} of mutants/{POOL}.meta" in error
        assert "--python X.Y" in error
        assert not (tmp_path / "mutation" / "ledger.json").exists()


def test_save_skips_the_hash_check_of_a_file_whose_source_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project_with_meta(tmp_path, {"x_f": OTHER}, with_source=False)
    (tmp_path / "mutation").mkdir()
    monkeypatch.chdir(tmp_path)
    assert ledger_module.main(["save", "--replace"]) == 0


def test_restore_under_another_python_than_the_hashes_refuses_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pyproject.toml").write_text(
        (MUTATION.parent / "pyproject.toml").read_text(encoding="utf-8"), encoding="utf-8"
    )
    monkeypatch.chdir(tmp_path)
    write_meta(tmp_path, {f"{PREFIX}{METHOD}__mutmut_1": 1}, {METHOD: "aaa"})
    fingerprint = ledger_module.config().config_fingerprint()
    ledger = ledger_module.updated_ledger(
        None, tmp_path / "mutants", fingerprint, every_file, "3.99"
    )
    (tmp_path / "mutation").mkdir()
    (tmp_path / "mutation" / "ledger.json").write_text(
        ledger_module.ledger_text(ledger), encoding="utf-8"
    )
    shutil.rmtree(tmp_path / "mutants")
    assert ledger_module.main(["restore"]) == 2
    error = capsys.readouterr().err
    assert f"hashes are Python 3.99's, and mutmut under {ledger_module.this_python()}" in error
    assert not (tmp_path / "mutants").exists()


def test_a_python_version_that_is_not_one_is_refused_on_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # were the option taken, nothing is written in the checkout
    with pytest.raises(SystemExit) as exit_info:
        ledger_module.main(["save", "--python", "3.x"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "expected a Python version such as 3.12, got '3.x'" in error


@pytest.mark.parametrize(("given", "recorded"), [("3.12", "3.12"), ("03.012", "3.12")])
def test_a_python_version_is_recorded_as_major_dot_minor(given: str, recorded: str) -> None:
    assert ledger_module.python_version(given) == recorded


@pytest.mark.parametrize("option", [["--python", "3.12"], ["--replace"]])
def test_restore_refuses_saves_options_on_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    option: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # were the options taken, nothing is written in the checkout
    with pytest.raises(SystemExit) as exit_info:
        ledger_module.main(["restore", *option])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "restore takes no --python nor --replace" in error


#: 20 killed mutants beside the cases' own: one survivor among 21 still scores 95.2%.
KILLED = {str(n): 1 for n in range(10, 30)}


@pytest.mark.parametrize(
    ("codes", "listed", "expected"),
    [
        ({"3": 0}, True, 0),  # all checked, the survivor listed
        ({"3": 0}, False, 1),  # a survivor missing from SURVIVORS.md
        ({"3": None}, True, 3),  # unchecked: inconclusive
        ({"3": None, "4": 0, "5": 0}, True, 1),  # 21/23 at best: below 95% whatever comes
        (None, True, 2),  # no results
    ],
)
def test_score_exit_status_says_pass_fail_or_inconclusive(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    codes: dict[str, int | None] | None,
    listed: bool,
    expected: int,
) -> None:
    every = {} if codes is None else {**KILLED, **codes}
    write_meta(tmp_path, {f"{PREFIX}{METHOD}__mutmut_{n}": c for n, c in every.items()}, {})
    survivors = tmp_path / "mutation" / "SURVIVORS.md"
    survivors.parent.mkdir()
    listed_names = ["4", "5"] + (["3"] if listed else [])
    survivors.write_text(
        "".join(f"`{PREFIX}{METHOD}__mutmut_{n}`\n" for n in listed_names), encoding="utf-8"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["score.py"])
    assert score_module.main() == expected
