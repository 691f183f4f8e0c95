"""The project's PEP 517 build backend: setuptools, plus mypyc where it can be used.

A wheel (``pip install .``, ``python -m build``) compiles the block pool with
mypyc, mypy's compiler, when mypy can be installed and a C compiler works;
otherwise it holds the same modules as pure Python, and the build prints one
line saying so and why. The editable install of the README always stays pure
Python, so that an edit to the source takes effect at once.

A free-threaded CPython always gets the pure Python wheel: mypyc 2.4.1's
runtime uses C API that CPython 3.13t lacks (``_PyObject_XDecRefDelayed``,
new in 3.14), and mypy's own ``ast-serialize`` has no 3.13t wheel. That is
why mypy is a *dynamic* build requirement (``get_requires_for_build_wheel``)
rather than a static one in ``pyproject.toml``: asked for there, it would
fail the whole install instead of falling back. Every other hook is
setuptools' own; ``setup.py`` asks :func:`compiled_extensions` what to build.

Which build is running afterwards: ``veloxquant_mlx.memory.block_pool.COMPILED``
or ``veloxquant-mlx --version``. ``VELOXQUANT_PURE=1`` asks for a pure wheel.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401 (the hooks this backend does not change)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

if TYPE_CHECKING:
    from setuptools import Extension

#: The compiler: mypy of exactly the version the compiled build is checked with (.ci/run).
MYPYC_REQUIREMENT = "mypy==2.4.1"

#: The allocator and every module it imports from the package, compiled together.
COMPILED_MODULES = (
    "veloxquant_mlx/memory/block_pool.py",
    "veloxquant_mlx/memory/_arguments.py",
    "veloxquant_mlx/memory/_history.py",
    "veloxquant_mlx/memory/_invariants.py",
    "veloxquant_mlx/memory/_prometheus.py",
)
#: Read by mypyc for its types (AsGiven, mypyc_attr) but not compiled: it holds no code.
ANALYSED_ONLY = ("veloxquant_mlx/memory/_mypyc.py",)
#: What every install needs at run time (``[project]`` declares its dependencies
#: dynamic, so that :func:`install_requirements` can add the compiled wheel's).
BASE_REQUIREMENTS = ("rich>=13", "numpy>=1.24")
#: What a compiled wheel needs besides: mypyc's run-time library, whose lock the
#: compiled pool calls directly (``_PoolLock`` in ``block_pool.py``). A pure wheel
#: does not ask for it (librt has no wheel for a free-threaded 3.13): the pool
#: takes librt's lock where it is installed anyway, ``threading.Lock`` elsewhere.
COMPILED_REQUIREMENTS = ("librt>=0.16",)
#: How mypy analyses the build: the rest of the package is followed silently, so a
#: missing optional dependency (mlx-lm, or numpy not installed yet) cannot fail it.
MYPYC_FLAGS = ("--follow-imports=silent",)

#: setup.py commands that build the modules a wheel ships (build_wheel runs bdist_wheel).
BUILDING_COMMANDS = frozenset({"bdist_wheel", "build", "build_ext", "install"})

#: What the probe compiles: the C compiler must exist and find Python's headers.
#: How much of the compiler's complaint the one-line notice keeps.
PROBE_MESSAGE_LIMIT = 120
PROBE_SOURCE = "#include <Python.h>\nint veloxquant_probe(void) { return Py_IsInitialized(); }\n"


def get_requires_for_build_wheel(config_settings: dict[str, str] | None = None) -> list[str]:
    """setuptools' requirements, and mypy unless this wheel cannot be compiled anyway."""
    requirements: list[str] = _setuptools.get_requires_for_build_wheel(config_settings)
    if interpreter_reason() is None:
        requirements.append(MYPYC_REQUIREMENT)
    return requirements


def install_requirements() -> list[str]:
    """The run-time requirements of the wheel this ``setup.py`` run describes or builds.

    pip asks for the metadata and then for the wheel in one build environment, so
    both runs get the same answer from :func:`pure_python_reason`. The editable
    install's environment has no mypyc, so it is pure and asks for no librt.
    """
    if pure_python_reason() is not None:
        return list(BASE_REQUIREMENTS)
    return [*BASE_REQUIREMENTS, *COMPILED_REQUIREMENTS]


def interpreter_reason() -> str | None:
    """Why this interpreter gets a pure Python build whatever is installed, or ``None``."""
    if os.environ.get("VELOXQUANT_PURE") == "1":
        return "VELOXQUANT_PURE=1 is set"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return (
            "free-threaded CPython, where the compiled build is neither buildable (mypyc "
            f"{MYPYC_REQUIREMENT.split('==')[1]} needs 3.14's C API) nor checked"
        )
    return None


@functools.cache  # asked twice per setup.py run (extensions, requirements); one probe
def pure_python_reason() -> str | None:
    """Why this build must be pure Python, or ``None`` if it can be compiled."""
    reason = interpreter_reason()
    if reason is not None:
        return reason
    try:
        import mypyc.build  # noqa: F401, PLC0415 (a build dependency, wanted only here)
    except ImportError as error:
        return f"mypyc cannot be imported ({error}); install mypy, or build with isolation"
    return c_compiler_problem()


def c_compiler_problem() -> str | None:
    """Compile a tiny extension source with the compiler setuptools would use."""
    from setuptools._distutils.ccompiler import new_compiler  # noqa: PLC0415
    from setuptools._distutils.sysconfig import customize_compiler  # noqa: PLC0415

    compiler = new_compiler()
    customize_compiler(compiler)
    executable = " ".join(getattr(compiler, "compiler_so", ["cc"])[:1])
    workdir = Path(tempfile.mkdtemp(prefix="veloxquant-cc-probe-"))
    try:
        source = workdir / "probe.c"
        source.write_text(PROBE_SOURCE)
        include = sysconfig.get_paths()["include"]
        compiler.compile([str(source)], output_dir=str(workdir), include_dirs=[include])
    except Exception as error:  # CompileError, or no compiler executable at all
        return f"no working C compiler ({executable}: {compiler_failure(error)})"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return None


def compiler_failure(error: Exception) -> str:
    """The gist of a failed probe, short enough for the notice's one line.

    setuptools words a failure as the whole command line, flags and temporary
    paths included, and then the outcome; only the outcome is worth a line.
    """
    message = " ".join(str(error).split()) or type(error).__name__
    outcome = message.rpartition("]' ")[2] if "]' " in message else message
    return outcome if len(outcome) <= PROBE_MESSAGE_LIMIT else outcome[:PROBE_MESSAGE_LIMIT] + "..."


def compiled_extensions() -> list[Extension]:
    """The mypyc extension modules for this ``setup.py`` run; empty for a pure build."""
    if not BUILDING_COMMANDS.intersection(sys.argv[1:]) or "editable_wheel" in sys.argv:
        return []  # metadata, an sdist or the editable install: nothing to compile
    reason = pure_python_reason()
    if reason is not None:
        print(f"veloxquant-mlx: block_pool stays pure Python: {reason}", file=sys.stderr)
        return []
    from mypyc.build import mypycify  # noqa: PLC0415

    print("veloxquant-mlx: compiling block_pool with mypyc", file=sys.stderr)
    extensions: list[Extension] = mypycify(
        [*MYPYC_FLAGS, *COMPILED_MODULES, *ANALYSED_ONLY],
        only_compile_paths=COMPILED_MODULES,
        opt_level="3",
        group_name="veloxquant_mlx",
    )
    return extensions
