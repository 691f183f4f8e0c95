"""The helpers every command shares (``veloxquant_mlx.commandline``), one behaviour each.

Verdicts and exit statuses (the table is pinned here once; each command's
own tests check that it follows it), one-line errors, option values and
memory figures, the SIGINT handler, atomic writes and ``--out``. Output
folders are refused before anything is created in them, and a write that
fails half-way leaves the old file whole.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from signal import SIGINT

import pytest

from veloxquant_mlx.commandline import files as files_module
from veloxquant_mlx.commandline import sigint
from veloxquant_mlx.commandline.bad_input import (
    BadInputError,
    OneLineParser,
    human_bytes,
    memory_note,
    require_fits_in_memory,
)
from veloxquant_mlx.commandline.files import (
    atomic_file,
    atomic_write_text,
    claim_new_folder,
    out_dir_argument,
    prepare_out_dir,
)
from veloxquant_mlx.commandline.interrupts import InterruptRequest, run_command
from veloxquant_mlx.commandline.values import MAX_INT, any_int, finite_float, int_at_least, int_in
from veloxquant_mlx.commandline.verdicts import (
    ExitStatus,
    Gap,
    Verdict,
    combined,
    percent_text,
    verdict_of,
)
from veloxquant_mlx.stress.report import RUN_FILE_NAMES, is_run_file

GAP = Gap("3 calls", "the budget ran out")


@pytest.mark.parametrize(
    ("verdict", "status"),
    [
        (Verdict.OK, 0),
        (Verdict.VIOLATION, 1),
        (Verdict.INCONCLUSIVE, 3),
        (Verdict.INTERRUPTED, 130),
    ],
)
def test_each_verdict_has_its_exit_status(verdict: Verdict, status: int) -> None:
    assert verdict.exit_status == status


def test_bad_input_exits_2() -> None:
    assert int(ExitStatus.BAD_INPUT) == 2


@pytest.mark.parametrize(
    ("violations", "gaps", "interrupted", "verdict"),
    [
        (0, (), False, Verdict.OK),
        (0, (GAP,), False, Verdict.INCONCLUSIVE),
        (1, (GAP,), False, Verdict.VIOLATION),
        (1, (GAP,), True, Verdict.INTERRUPTED),
        (0, (), True, Verdict.INTERRUPTED),
    ],
)
def test_a_gap_is_never_ok_and_a_violation_outranks_it(
    violations: int, gaps: tuple[Gap, ...], interrupted: bool, verdict: Verdict
) -> None:
    assert verdict_of(violations=violations, gaps=gaps, interrupted=interrupted) is verdict


@pytest.mark.parametrize(
    ("verdicts", "verdict"),
    [
        ([], Verdict.OK),
        ([Verdict.OK, Verdict.INCONCLUSIVE, Verdict.OK], Verdict.INCONCLUSIVE),
        ([Verdict.INCONCLUSIVE, Verdict.VIOLATION], Verdict.VIOLATION),
        ([Verdict.VIOLATION, Verdict.INTERRUPTED], Verdict.INTERRUPTED),
    ],
)
def test_several_checks_combine_to_their_worst_verdict(
    verdicts: list[Verdict], verdict: Verdict
) -> None:
    assert combined(verdicts) is verdict


def test_a_gap_says_what_was_not_checked_and_why() -> None:
    assert str(GAP) == "3 calls not checked: the budget ran out"
    assert GAP.to_json() == {"what": "3 calls", "why": "the budget ran out"}


# -- one-line errors -------------------------------------------------------------------------


def test_a_usage_error_is_one_line_naming_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    parser = OneLineParser(prog="tool")
    parser.add_argument("--depth", type=int)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--depth", "deep"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "tool: error: argument --depth: invalid int value: 'deep' (see --help)\n"
    )


def test_run_command_turns_bad_input_into_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def body() -> int:
        raise BadInputError("--size 7 is odd; expected an even size")

    assert run_command("tool", body) == 2
    assert capsys.readouterr().err == "tool: error: --size 7 is odd; expected an even size\n"


def test_run_command_turns_ctrl_c_into_one_line_and_status_130(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def body() -> int:
        raise KeyboardInterrupt

    assert run_command("tool", body) == 130
    assert capsys.readouterr().err == "tool: interrupted\n"


def test_input_that_cannot_fit_is_refused_naming_it() -> None:
    with pytest.raises(BadInputError, match=r"n_layers=10\b.*needs about 2 GiB.*machine's 1 GiB"):
        require_fits_in_memory(2 * 2**30, "n_layers=10", limit=2**30)
    require_fits_in_memory(2**30, "n_layers=5", limit=2**30)  # fits exactly: accepted


def test_a_run_bigger_than_the_memory_free_now_is_allowed_with_a_note() -> None:
    assert memory_note(2**30, available=2**31) == "about 1 GiB"
    assert memory_note(2**31, available=2**30) == "about 2 GiB (more than the 1 GiB free now)"


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (5, "5 bytes"),
        (1536, "1.5 KiB"),
        (1023 * 2**20, "1023 MiB"),
        (3 * 2**50, "3 PiB"),
        (2**70, "2**70 bytes"),
        (10**400, "2**1328 bytes"),  # beyond any float: once an OverflowError and a traceback
    ],
)
def test_human_bytes(count: int, text: str) -> None:
    assert human_bytes(count) == text


# -- option values ---------------------------------------------------------------------------

HUGE = "1" + "0" * 400  # above any float


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (int_at_least(1), "0", "expected an int >= 1, got '0'"),
        (int_at_least(1), str(MAX_INT + 1), "expected an int >= 1 and <= 2**63-1, got"),
        (int_at_least(1), HUGE, "expected an int >= 1 and <= 2**63-1, got '1000"),
        (int_in(1, 1000), "1001", "expected an int from 1 to 1000, got '1001'"),
        (any_int, HUGE, "expected an int from -2**63 to 2**63-1, got '1000"),
        (any_int, "seven", "expected an int, got 'seven'"),
        (finite_float(0, low_inclusive=False), HUGE, "expected a finite number > 0, got '1000"),
    ],
)
def test_an_option_value_out_of_range_is_refused_naming_it_and_the_range(
    parse: Callable[[str], object], text: str, message: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse(text)
    assert str(error.value).startswith(message)


def test_a_value_too_long_to_quote_is_shortened_with_its_length() -> None:
    with pytest.raises(argparse.ArgumentTypeError) as error:
        int_at_least(1)("9" * 5000)  # more digits than int() parses
    quoted = "'99999999999999999999'... (5,000 characters)"
    assert str(error.value) == f"expected an int >= 1, got {quoted}"


def test_the_largest_int_is_accepted() -> None:
    assert int_at_least(0)(str(MAX_INT)) == MAX_INT
    assert any_int(str(-MAX_INT - 1)) == -MAX_INT - 1


@pytest.mark.parametrize(
    ("part", "whole", "text"),
    [
        (0, 0, "100.0%"),
        (5, 5, "100.0%"),
        (0, 5, "0.0%"),
        (621, 1000, "62.1%"),
        (99_999, 100_000, "99.9%"),
        (1, 100_000, "0.1%"),
    ],
)
def test_a_percentage_has_one_decimal_and_never_rounds_to_all_or_none(
    part: int, whole: int, text: str
) -> None:
    assert percent_text(part, whole) == text


# -- interrupts --------------------------------------------------------------------------------


def test_a_first_sigint_only_requests_a_stop_and_a_quick_repeat_is_the_same_one() -> None:
    before = signal.getsignal(signal.SIGINT)
    with InterruptRequest("tool") as interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # `timeout -s INT` sends two at once
        assert interrupt.requested.is_set()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_sigint_in_single_threaded_code_raises_once_and_its_quick_repeat_is_ignored() -> None:
    def body() -> int:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), SIGINT)
        os.kill(os.getpid(), SIGINT)  # while the first unwinds: `timeout -s INT` sends two
        return 0

    before = signal.getsignal(SIGINT)
    assert run_command("tool", body) == 0
    assert signal.getsignal(SIGINT) is before


def test_code_that_polls_is_never_interrupted_by_an_exception(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen = []

    def body() -> int:
        with InterruptRequest("tool") as interrupt:
            os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt may land here
            seen.append(interrupt.requested.is_set())
        return 7

    assert run_command("tool", body) == 7
    assert seen == [True]
    assert capsys.readouterr().err == ""


def test_one_handler_serves_a_command_run_inside_another() -> None:
    handlers = []

    def inner() -> int:
        handlers.append(sigint.active_handler())
        return 0

    def outer() -> int:
        handlers.append(sigint.active_handler())
        return run_command("inner", inner)

    assert run_command("outer", outer) == 0
    assert handlers[0] is not None
    assert handlers == [handlers[0], handlers[0]]
    assert sigint.active_handler() is None


# -- atomic writes -------------------------------------------------------------------------


def test_a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text("old\n")
    with pytest.raises(KeyboardInterrupt), atomic_file(target) as file:
        file.write("half of the new")
        raise KeyboardInterrupt
    assert target.read_text() == "old\n"
    assert [path.name for path in tmp_path.iterdir()] == ["report.json"]


def test_an_atomic_write_replaces_the_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "summary.txt"
    atomic_write_text(target, "first\n")
    atomic_write_text(target, "second\n")
    assert target.read_text() == "second\n"
    assert [path.name for path in tmp_path.iterdir()] == ["summary.txt"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_atomic_write_makes_a_file_as_open_would_not_a_private_one(
    tmp_path: Path, umask: int
) -> None:
    previous = os.umask(umask)  # the test's own process: files.py no longer touches it
    try:
        plain, atomic = tmp_path / "plain.txt", tmp_path / "atomic.txt"
        plain.write_text("x")
        atomic_write_text(atomic, "x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(atomic.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    assert stat.S_IMODE(atomic.stat().st_mode) == 0o666 & ~umask


def test_atomic_writes_never_set_the_process_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the umask means setting it: a race with every other thread of the process."""
    calls: list[int] = []

    def umask(mask: int) -> int:
        calls.append(mask)
        return 0o022

    monkeypatch.setattr(os, "umask", umask)
    importlib.reload(files_module)
    files_module.atomic_write_text(tmp_path / "report.json", "{}")
    assert calls == []


# -- --out -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "   "])
def test_an_empty_out_is_refused_rather_than_meaning_the_current_folder(text: str) -> None:
    with pytest.raises(Exception, match="expected a folder path"):
        out_dir_argument(text)


def test_an_out_folder_with_an_earlier_report_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text("{}")
    (tmp_path / "violation-linearizability.json").write_text("{}")
    with pytest.raises(BadInputError, match=r"earlier run's files .*--force"):
        prepare_out_dir(tmp_path, force=False, is_run_file=is_run_file)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "report.json",
        "violation-linearizability.json",
    ]


def test_force_deletes_only_an_earlier_runs_files(tmp_path: Path) -> None:
    for name in ("report.json", "summary.txt", "violation-linearizability.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    prepare_out_dir(tmp_path, force=True, is_run_file=is_run_file)
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]


def test_an_out_folder_that_cannot_be_made_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(BadInputError, match="is a file"):
        prepare_out_dir(blocker, force=False, is_run_file=is_run_file)
    with pytest.raises(BadInputError, match="cannot be created or written"):
        prepare_out_dir(blocker / "below" / "deeper", force=False, is_run_file=is_run_file)
    assert [path.name for path in tmp_path.iterdir()] == ["a-file"]


def test_a_new_out_folder_is_created_with_its_parents(tmp_path: Path) -> None:
    folder = tmp_path / "reports" / "night-1"
    prepare_out_dir(folder, force=False, is_run_file=is_run_file)
    assert folder.is_dir()
    assert list(folder.iterdir()) == []


def test_every_file_a_stress_run_writes_is_one_an_earlier_run_left() -> None:
    from veloxquant_mlx.stress import replay, report, reproducer

    written = {
        replay.TRACE_NAME,
        replay.PARTIAL_TRACE_NAME,
        reproducer.REPRODUCER_NAME,
        report.REPORT_NAME,
        report.SUMMARY_NAME,
        report.STACKS_NAME,
    }
    assert written == RUN_FILE_NAMES
    assert all(is_run_file(name) for name in written)
    assert is_run_file("violation-linearizability.json")  # version 1's reproducer
    assert not any(map(is_run_file, ["notes.txt", "violation-notes.json", "report.json.bak"]))


def test_runs_started_in_one_second_claim_their_own_default_folders(tmp_path: Path) -> None:
    # Once the second run of a second was refused: its default folder held the first's files.
    base = tmp_path / "reports" / "stress-smoke-20261202-204149"
    claimed = [claim_new_folder(base) for _ in range(3)]
    assert [path.name for path in claimed] == [base.name, f"{base.name}-2", f"{base.name}-3"]
    assert all(path.is_dir() for path in claimed)


def test_a_default_folder_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "reports"
    blocker.write_text("a file, not a folder")
    with pytest.raises(BadInputError, match="cannot be created"):
        claim_new_folder(blocker / "stress-smoke")
