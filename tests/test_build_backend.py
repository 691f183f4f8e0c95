"""When a wheel stays pure Python, and that it says so in one line (``build_backend.py``).

A wheel compiles the allocator with mypyc unless it cannot: no working C
compiler, a free-threaded CPython (mypyc 2.4.1 cannot build for 3.13t), or
``VELOXQUANT_PURE=1``. Each of these builds a pure wheel and prints one line
naming the reason; the editable install compiles nothing and prints nothing.
A compiled wheel also requires librt (the compiled pool calls its lock); a
pure one does not.
The real builds are slow, so these tests call the backend's hooks the way
setuptools does, with the interpreter or the compiler swapped out.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTICE_PREFIX = "veloxquant-mlx: block_pool stays pure Python: "


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``build_backend.py`` from the source tree (also when the suite runs against a wheel)."""
    spec = importlib.util.spec_from_file_location("build_backend", REPO_ROOT / "build_backend.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("VELOXQUANT_PURE", raising=False)
    monkeypatch.setattr(module._setuptools, "get_requires_for_build_wheel", lambda _config: [])
    return module


def building_a_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``setup.py`` as ``build_wheel`` runs it."""
    monkeypatch.setattr(sys, "argv", ["setup.py", "bdist_wheel"])


def pretend_free_threaded(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sysconfig.get_config_var
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda name: 1 if name == "Py_GIL_DISABLED" else real(name)
    )


def only_notice(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(NOTICE_PREFIX), lines[0]
    return lines[0].removeprefix(NOTICE_PREFIX)


def test_a_free_threaded_interpreter_builds_a_pure_wheel_and_says_why(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pretend_free_threaded(monkeypatch)
    building_a_wheel(monkeypatch)
    assert backend.get_requires_for_build_wheel() == [], "mypy would fail a 3.13t install"
    assert backend.compiled_extensions() == []
    assert only_notice(capsys).startswith("free-threaded CPython")


def test_without_a_c_compiler_the_wheel_is_pure_and_says_which_compiler_failed(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mypyc.build", reason="the compiler check runs only once mypyc imports")
    monkeypatch.setenv("CC", "/bin/false")
    building_a_wheel(monkeypatch)
    assert backend.get_requires_for_build_wheel() == [backend.MYPYC_REQUIREMENT]
    assert backend.compiled_extensions() == []
    notice = only_notice(capsys)
    assert notice.startswith("no working C compiler (/bin/false: "), notice
    assert len(notice) < 200, "the notice is one readable line, not a command line"


def test_veloxquant_pure_asks_for_a_pure_wheel(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VELOXQUANT_PURE", "1")
    building_a_wheel(monkeypatch)
    assert backend.get_requires_for_build_wheel() == []
    assert backend.compiled_extensions() == []
    assert only_notice(capsys) == "VELOXQUANT_PURE=1 is set"


def test_the_editable_install_compiles_nothing_and_prints_nothing(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["setup.py", "editable_wheel"])
    assert backend.compiled_extensions() == []
    assert capsys.readouterr().err == ""


def test_a_compiled_wheel_requires_librt_for_its_lock(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend, "pure_python_reason", lambda: None)
    assert backend.install_requirements() == ["rich>=13", "numpy>=1.24", "librt>=0.16"]


def test_a_pure_wheel_does_not_require_librt(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    pretend_free_threaded(monkeypatch)  # librt has no wheel for 3.13t
    assert backend.install_requirements() == ["rich>=13", "numpy>=1.24"]
