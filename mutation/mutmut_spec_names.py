"""pytest plugin for mutation runs only: lets mutmut find the spec's mutants.

mutmut 3 names a mutant after the file it lives in, so the spec's mutants
are ``spec.veloxquant_mlx_spec.<module>.x_<function>__mutmut_<n>``. The
tests import the spec as ``veloxquant_mlx_spec`` (pytest's ``pythonpath``
maps ``spec/``), so at run time every spec function's ``__module__`` lacks
the ``spec.`` prefix. Left alone, mutmut would record no test for any spec
function (every spec mutant "no tests") and would never switch a spec
mutant on (its module name never matches).

This plugin rewrites the two names at mutmut's trampoline, the one place
they meet: the name a covered function is recorded under gains ``spec.``,
and the active mutant's name loses it. Nothing else changes; modules
outside the spec pass through untouched. ``[tool.mutmut]`` loads it with
``-p mutation.mutmut_spec_names``; a plain ``pytest`` run never does.

Checked against mutmut 3.8.1: it fails loudly if the two hooks it wraps are
missing, rather than silently leaving every spec mutant untested.
"""

from __future__ import annotations

from mutmut.mutation import trampoline

# The mutation runs' other plugin comes in through this one, so that [tool.mutmut]'s
# pytest arguments, part of mutmut's configuration fingerprint, stay as they are.
pytest_plugins = ["mutation.fastest_first"]

IMPORTED_PREFIX = "veloxquant_mlx_spec."
ON_DISK_PREFIX = "spec.veloxquant_mlx_spec."

# The trampoline module's globals: its functions look both hooks up here on every call.
_trampoline_globals = vars(trampoline)
for _hook in ("record_trampoline_hit", "get_mutant_under_test"):
    if not callable(_trampoline_globals.get(_hook)):
        raise ImportError(
            f"mutmut.mutation.trampoline.{_hook} not found; this plugin was written "
            "against mutmut 3.8.1 and must be updated for the installed mutmut"
        )


def on_disk_name(name: str) -> str:
    """``veloxquant_mlx_spec.model.x_f`` -> ``spec.veloxquant_mlx_spec.model.x_f``."""
    if name.startswith(IMPORTED_PREFIX):
        return "spec." + name
    return name


def imported_name(name: str) -> str:
    """``spec.veloxquant_mlx_spec.model.x_f__mutmut_1`` -> ``veloxquant_mlx_spec.model...``."""
    if name.startswith(ON_DISK_PREFIX):
        return name.removeprefix("spec.")
    return name


_record_trampoline_hit = _trampoline_globals["record_trampoline_hit"]
_get_mutant_under_test = _trampoline_globals["get_mutant_under_test"]


def _record_under_on_disk_name(name: str, caller: str | None = None) -> None:
    _record_trampoline_hit(on_disk_name(name), None if caller is None else on_disk_name(caller))


def _mutant_under_imported_name() -> str:
    return imported_name(str(_get_mutant_under_test()))


# Idempotent: pytest imports a plugin module once per process.
_trampoline_globals["record_trampoline_hit"] = _record_under_on_disk_name
_trampoline_globals["get_mutant_under_test"] = _mutant_under_imported_name
