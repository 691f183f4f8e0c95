"""Which build of the allocator runs: ``block_pool.COMPILED`` and ``--version`` tell the truth.

The same source runs interpreted (the editable install, where an edit must
take effect at once) or compiled by mypyc (a wheel built where a C compiler
was found). CI runs the allocator's suites once per build; these tests make
sure each run checks the build it claims to: ``VELOXQUANT_EXPECT_BUILD``
(``compiled`` or ``interpreted``) names the build a run expects, and the
source tree of the README's set-up is always interpreted.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
from importlib.machinery import ExtensionFileLoader
from pathlib import Path

import pytest

from veloxquant_mlx import cli
from veloxquant_mlx.memory import block_pool

EXPECT_BUILD_VARIABLE = "VELOXQUANT_EXPECT_BUILD"
REPO_ROOT = Path(__file__).resolve().parent.parent


def compiled_module_names() -> tuple[str, ...]:
    """The modules ``build_backend.py`` compiles (block_pool and every module it imports
    from the package), as module names: they are compiled together or not at all."""
    spec = importlib.util.spec_from_file_location("build_backend", REPO_ROOT / "build_backend.py")
    assert spec is not None and spec.loader is not None
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    paths: tuple[str, ...] = backend.COMPILED_MODULES
    return tuple(path.removesuffix(".py").replace("/", ".") for path in paths)


ALLOCATOR_MODULES = compiled_module_names()


def is_extension_module(name: str) -> bool:
    spec = importlib.import_module(name).__spec__
    assert spec is not None, name
    return isinstance(spec.loader, ExtensionFileLoader)


def imported_from_source_tree() -> bool:
    return Path(block_pool.__file__).resolve().is_relative_to(REPO_ROOT)


def test_compiled_is_true_exactly_when_block_pool_is_an_extension_module() -> None:
    assert block_pool.COMPILED is is_extension_module("veloxquant_mlx.memory.block_pool")


def package_imports(module_name: str) -> set[str]:
    """The ``veloxquant_mlx`` modules that ``module_name``'s source imports from."""
    source = REPO_ROOT / (module_name.replace(".", "/") + ".py")
    tree = ast.parse(source.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("veloxquant_mlx"):
            for alias in node.names:  # `from package import module` imports the module
                submodule = f"{node.module}.{alias.name}"
                is_module = (REPO_ROOT / (submodule.replace(".", "/") + ".py")).exists()
                imported.add(submodule if is_module else str(node.module))
    return imported


def test_the_compiled_modules_import_only_each_other_from_the_package() -> None:
    assert "veloxquant_mlx.memory.block_pool" in ALLOCATOR_MODULES
    imported = set().union(*(package_imports(name) for name in ALLOCATOR_MODULES))
    code_free = {"veloxquant_mlx.memory._mypyc"}  # types only: analysed, not compiled
    assert imported - code_free <= set(ALLOCATOR_MODULES), imported


def test_the_allocator_modules_are_all_of_one_build() -> None:
    builds = {name: is_extension_module(name) for name in ALLOCATOR_MODULES}
    assert set(builds.values()) == {block_pool.COMPILED}, builds


def test_the_running_build_is_the_one_this_run_expects() -> None:
    expected = os.environ.get(EXPECT_BUILD_VARIABLE)
    if expected is None and imported_from_source_tree():
        expected = "interpreted"  # the editable install: source edits take effect at once
    if expected is None:
        pytest.skip(f"{EXPECT_BUILD_VARIABLE} is unset and block_pool is installed")
    assert expected in {"compiled", "interpreted"}, f"{EXPECT_BUILD_VARIABLE}={expected!r}"
    assert block_pool.COMPILED is (expected == "compiled"), block_pool.__file__
    if expected == "compiled":
        assert not imported_from_source_tree(), "the source tree shadows the installed wheel"


def test_version_names_the_running_build(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    build = "compiled by mypyc" if block_pool.COMPILED else "interpreted (pure Python)"
    assert out.splitlines()[1] == f"block_pool: {build}, {block_pool.__file__}"
