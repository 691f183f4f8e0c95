"""What every command shares: verdicts and exit statuses, one-line errors, ``--out``, writes.

The table of exit statuses is pinned here once; each command's own tests
check that it follows it. Output folders are refused before anything is
created in them, and a write that fails half-way leaves the old file whole.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from veloxquant_mlx.commandline.bad_input import (
    BadInputError,
    OneLineParser,
    human_bytes,
    require_fits_in_memory,
)
from veloxquant_mlx.commandline.files import (
    atomic_file,
    atomic_write_text,
    out_dir_argument,
    prepare_out_dir,
)
from veloxquant_mlx.commandline.interrupts import InterruptRequest, run_command
from veloxquant_mlx.commandline.verdicts import ExitStatus, Gap, Verdict, combined, verdict_of
from veloxquant_mlx.stress.report import is_run_file

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
    with pytest.raises(BadInputError, match=r"n_layers=10\b.*needs about 2 GiB.*1 GiB available"):
        require_fits_in_memory(2 * 2**30, "n_layers=10", available=2**30)
    require_fits_in_memory(2**30, "n_layers=5", available=2**30)  # fits exactly: accepted


@pytest.mark.parametrize(
    ("count", "text"),
    [(5, "5 bytes"), (1536, "1.5 KiB"), (1023 * 2**20, "1023 MiB"), (3 * 2**50, "3 PiB")],
)
def test_human_bytes(count: int, text: str) -> None:
    assert human_bytes(count) == text


# -- interrupts --------------------------------------------------------------------------------


def test_a_first_sigint_only_requests_a_stop_and_a_quick_repeat_is_the_same_one() -> None:
    before = signal.getsignal(signal.SIGINT)
    with InterruptRequest("tool") as interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # `timeout -s INT` sends two at once
        assert interrupt.requested.is_set()
    assert signal.getsignal(signal.SIGINT) is before


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


def test_an_atomic_write_makes_a_file_as_open_would_not_a_private_one(tmp_path: Path) -> None:
    plain, atomic = tmp_path / "plain.txt", tmp_path / "atomic.txt"
    plain.write_text("x")
    atomic_write_text(atomic, "x")
    assert atomic.stat().st_mode == plain.stat().st_mode


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
