"""``stress/nightly.sh`` fails the night on an inconclusive run; it never mixes two nights.

The script is run with a stand-in interpreter that exits with a chosen
status (as ``python -m stress`` would) and writes a summary, so each verdict's
handling is checked in a second, without ten-minute runs. A report folder
that holds an earlier night is refused up front, or cleared with
``--force``, and SUMMARY.txt holds this night's runs only. A crashed
decode-thread soak (the stand-in exits as its pytest would) fails the night.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def fake_interpreter(tmp_path: Path, status: int, soak_status: int, ft_status: int) -> Path:
    """An executable that writes a summary into its ``--out`` folder and exits ``status``;
    run as ``-m pytest`` it exits ``ft_status`` for the free-threaded thread tests
    (``VELOXQUANT_FT_SUITE`` set), else ``soak_status`` (the decode-thread soak)."""
    script = tmp_path / "fake-python"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f"if [[ $2 == pytest && -n ${{VELOXQUANT_FT_SUITE:-}} ]]; then exit {ft_status}; fi\n"
        f"if [[ $2 == pytest ]]; then\n"
        f'  (({soak_status})) || echo "1 passed"\n'
        f"  exit {soak_status}\n"
        "fi\n"
        "while [[ $# -gt 0 ]]; do [[ $1 == --out ]] && out=$2; shift; done\n"
        'mkdir -p "$out" && echo "stress nightly: (fake)" > "$out/summary.txt"\n'
        f"exit {status}\n"
    )
    script.chmod(0o755)
    return script


def run_nightly(
    tmp_path: Path,
    status: int,
    *options: str,
    soak_status: int = 0,
    soak_seconds: str = "600",
    free_threaded: bool = False,
    ft_status: int = 0,
) -> subprocess.CompletedProcess[str]:
    """The night with the stand-in as ``PYTHON`` (and as ``FT_PYTHON`` if ``free_threaded``)."""
    python = fake_interpreter(tmp_path, status, soak_status, ft_status)
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHON": str(python),
        "FT_PYTHON": str(python if free_threaded else tmp_path / "none"),
        "SOAK_SECONDS": soak_seconds,
    }
    return subprocess.run(
        ["bash", str(ROOT / "stress" / "nightly.sh"), *options, str(tmp_path / "reports")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("status", "night", "word"),
    [(0, 0, "OK"), (1, 1, "VIOLATION"), (3, 3, "INCONCLUSIVE"), (7, 1, "FAILED to run")],
)
def test_each_runs_verdict_decides_the_nights_exit_status(
    tmp_path: Path, status: int, night: int, word: str
) -> None:
    result = run_nightly(tmp_path, status)
    assert result.returncode == night, result.stdout + result.stderr
    assert result.stdout.count(f"   {word}") == 3  # the three GIL runs
    headline = (tmp_path / "reports" / "SUMMARY.txt").read_text().splitlines()[0]
    assert headline.endswith(": OK") is (night == 0)
    assert ("FAILED" in headline) is (night != 0)
    assert ("inconclusive" in headline) is (status == 3)


def test_an_interrupted_run_stops_the_night_with_130(tmp_path: Path) -> None:
    result = run_nightly(tmp_path, 130)
    assert result.returncode == 130
    assert result.stdout.count("INTERRUPTED") == 1  # the later runs are skipped
    assert (tmp_path / "reports" / "SUMMARY.txt").exists()


def test_a_second_night_into_the_same_folder_is_refused_up_front_and_changes_nothing(
    tmp_path: Path,
) -> None:
    assert run_nightly(tmp_path, 0).returncode == 0
    summary = tmp_path / "reports" / "SUMMARY.txt"
    before = summary.read_text()
    result = run_nightly(tmp_path, 0)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("nightly.sh: error: REPORT_DIR ")
    assert "--force" in result.stderr
    assert summary.read_text() == before


def test_force_reruns_into_the_folder_and_summarizes_this_night_only(tmp_path: Path) -> None:
    assert run_nightly(tmp_path, 0).returncode == 0
    stale = tmp_path / "reports" / "ft-separate-kv"  # a run this night does not make
    stale.mkdir()
    (stale / "summary.txt").write_text("stress nightly: VIOLATION (last week)\n")
    result = run_nightly(tmp_path, 0, "--force")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "reports" / "SUMMARY.txt").read_text()
    assert [line for line in summary.splitlines() if line.startswith("## ")] == [
        "## gil-separate-kv",
        "## gil-shared-kv",
        "## gil-no-grow",
        "## decode-thread-soak",
        "## free-threaded-skipped",
    ]
    assert "last week" not in summary


def test_the_free_threaded_thread_tests_verdict_is_this_nights_and_in_the_summary(
    tmp_path: Path,
) -> None:
    assert run_nightly(tmp_path, 0, free_threaded=True).returncode == 0
    result = run_nightly(tmp_path, 0, "--force", free_threaded=True, ft_status=1)
    assert result.returncode == 1, result.stdout + result.stderr
    verdict = "ft-thread-tests: FAILED (see ft-thread-tests.log)"
    assert (tmp_path / "reports" / "ft-thread-tests.txt").read_text() == verdict + "\n"
    summary = (tmp_path / "reports" / "SUMMARY.txt").read_text()
    assert f"## ft-thread-tests\n{verdict}" in summary
    assert "ft-thread-tests: OK" not in summary  # last night's verdict is gone


def test_a_night_without_a_free_threaded_interpreter_says_so_in_the_summary(
    tmp_path: Path,
) -> None:
    assert run_nightly(tmp_path, 0).returncode == 0
    summary = (tmp_path / "reports" / "SUMMARY.txt").read_text()
    assert "## free-threaded-skipped\nno free-threaded interpreter at FT_PYTHON=" in summary


def test_a_crashed_decode_thread_soak_fails_the_night_and_says_so_in_the_summary(
    tmp_path: Path,
) -> None:
    result = run_nightly(tmp_path, 0, soak_status=139)  # a segfault
    assert result.returncode == 1, result.stdout + result.stderr
    assert "decode-thread-soak: FAILED, exit status 139" in result.stdout
    summary = (tmp_path / "reports" / "SUMMARY.txt").read_text()
    assert summary.splitlines()[0].endswith(": FAILED")
    assert "## decode-thread-soak\ndecode-thread-soak: FAILED, exit status 139" in summary


def test_soak_seconds_0_skips_the_soak(tmp_path: Path) -> None:
    result = run_nightly(tmp_path, 0, soak_status=139, soak_seconds="0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decode-thread-soak" not in result.stdout
    assert "decode-thread-soak" not in (tmp_path / "reports" / "SUMMARY.txt").read_text()


def test_a_soak_that_did_not_run_fails_the_night(tmp_path: Path) -> None:
    result = run_nightly(tmp_path, 0, soak_seconds="ten")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "SOAK_SECONDS='ten' is not a whole number of seconds" in result.stdout


def test_ctrl_c_in_the_soak_stops_the_night_with_130(tmp_path: Path) -> None:
    result = run_nightly(tmp_path, 0, soak_status=2)  # pytest, interrupted
    assert result.returncode == 130, result.stdout + result.stderr
    assert result.stdout.count("INTERRUPTED") == 1
