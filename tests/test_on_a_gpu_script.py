"""``benchmarks/on_a_gpu.sh`` runs the device-dependent tests and the decode benchmark on
a GPU only, writes every output into its folder, and fails when either fails.

The script is run with a stand-in interpreter that answers the device question as
told, exits with a chosen status as pytest and the benchmark, and records the
arguments it was given, so each path is checked in a second, on any machine.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "on_a_gpu.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def fake_interpreter(tmp_path: Path, device: str, tests: int = 0, bench: int = 0) -> Path:
    """An executable that prints ``device`` for ``-c`` (fails to import MLX if it is
    ``"none"``), exits ``tests`` as ``-m pytest`` and ``bench`` as the benchmark; every
    call's arguments go to ``calls.txt``."""
    script = tmp_path / "fake-python"
    imports = "exit 1" if device == "none" else f'echo "0.32.4 Device({device}, 0)"; exit 0'
    script.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {tmp_path / "calls.txt"}\n'
        f"if [[ $1 == -c ]]; then {imports}; fi\n"
        f'if [[ $2 == pytest ]]; then echo "13 passed"; exit {tests}; fi\n'
        'echo "{}"; echo "decode: done" >&2\n'
        f"exit {bench}\n"
    )
    script.chmod(0o755)
    return script


def run(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(python)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run(fake_interpreter(tmp_path, "cpu"), str(out))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "on_a_gpu.sh: MLX's default device is not a GPU (0.32.4 Device(cpu, 0)); its "
        "figures would be the CPU's"
    ]
    assert not out.exists()


def test_without_mlx_it_refuses_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    python = fake_interpreter(tmp_path, "none")
    done = run(python, str(out))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"on_a_gpu.sh: MLX does not import with {python}"]
    assert not out.exists()


@pytest.mark.parametrize("args", [["a", "b"], ["--full"], ["--quick", "a", "b"]])
def test_bad_arguments_are_refused_in_one_line(tmp_path: Path, args: list[str]) -> None:
    done = run(fake_interpreter(tmp_path, "gpu"), *args)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("on_a_gpu.sh: expected [--quick] [OUT], got: ")
    assert not (tmp_path / "calls.txt").exists()  # refused before MLX is asked anything


def test_on_a_gpu_every_output_lands_in_the_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run(fake_interpreter(tmp_path, "gpu"), "--quick", str(out))
    assert done.returncode == 0, done.stderr
    assert (out / "device.txt").read_text() == "0.32.4 Device(gpu, 0)\n"
    assert (out / "tests.txt").read_text() == "13 passed\n"
    assert (out / "bench_kv_cache.json").read_text() == "{}\n"
    assert (out / "bench_kv_cache.log").read_text() == "decode: done\n"
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    pytest_call = calls[1].split()
    assert pytest_call[:5] == ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
    named = pytest_call[5:]
    assert len(named) == 13
    assert all((ROOT / path).is_file() for path in named), named
    assert calls[2] == "benchmarks/bench_kv_cache.py --skip-memory --contexts 256 4096"


@pytest.mark.parametrize(("tests", "bench"), [(1, 0), (0, 1)], ids=["a test", "the benchmark"])
def test_a_failure_of_either_fails_the_run(tmp_path: Path, tests: int, bench: int) -> None:
    out = tmp_path / "out"
    done = run(fake_interpreter(tmp_path, "gpu", tests, bench), str(out))
    assert done.returncode == 1
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    # The benchmark runs after a failed test, at every context without --quick.
    assert calls[2:] == ["benchmarks/bench_kv_cache.py --skip-memory"]
