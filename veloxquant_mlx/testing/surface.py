"""Checks of what a port can get wrong outside any call sequence (docs/CONFORMANCE_KIT.md).

Each check builds fresh pools through the :class:`~veloxquant_mlx.testing.port.Port`
and returns :class:`~veloxquant_mlx.testing.findings.Finding` values, each
with the few lines of Python that show it:

- :func:`check_names`: every name of docs/API.md on the pool, its stats and
  its blocks (C-NAMES); the kit reads nothing private (no ``_fragmented_count``);
- :func:`check_stats_snapshot`: ``stats`` and ``history`` entries are
  independent snapshots (C-STATS-SNAPSHOT);
- :func:`check_prometheus`: the text parses and carries each metric's
  ``# HELP``/``# TYPE`` lines, its type, the prefix and the final newline (C-PROMETHEUS);
- :func:`check_error_classes`: the four error classes exist with their bases
  (C-ERROR-CLASSES);
- :func:`check_config_validation`: the port's config (or factory, for plain
  values) accepts and rejects what the spec's ``make_config`` does
  (C-CONFIG-TYPES, C-CONFIG-VALUES, C-CONFIG-EMPTY, C-CONFIG-MAX-IGNORED);
- :func:`check_default_history`: a pool built without ``history_len`` keeps
  the last 1024 snapshots, equal to the spec's (C-HISTORY);
- :func:`bad_argument_calls`: every bad value of every argument, one call
  each on a fresh pool, compared in lockstep (``n_free`` of a bad stream included).

Complexity: each check is O(1) pools and calls, except the history check
(about 1,000 calls). Thread safety: each check builds its own pools.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Final

from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.testing.findings import Finding, finding_from_error
from veloxquant_mlx.testing.lockstep import Check, ConformanceError, Lockstep
from veloxquant_mlx.testing.port import DEFAULT_HISTORY_LEN, Port
from veloxquant_mlx.testing.python_text import read_line
from veloxquant_mlx.testing.sides import HANDLE_FIELDS, parse_prometheus
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.operations import (
    DEFAULT_PROMETHEUS_PREFIX,
    Allocate,
    FreeAll,
    prometheus_samples,
)
from veloxquant_mlx_spec.table import ArgKind, Declaration, Handle, declarations, stats_values

__all__ = [
    "CONFIG_CASES",
    "SURFACE_CHECKS",
    "bad_argument_calls",
    "check_config_validation",
    "check_default_history",
    "check_error_classes",
    "check_names",
    "check_prometheus",
    "check_stats_snapshot",
]

#: A small pool for the checks that need one.
SMALL: Final = model.SpecConfig(block_size=2, n_blocks=4)
#: Metric types by name (docs/CONTRACT.md C-PROMETHEUS): the counters end in ``_total``.
_TYPE_LINE: Final = re.compile(r"# TYPE (\S+) (\S+)")
_HELP_LINE: Final = re.compile(r"# HELP (\S+) \S")
ERROR_BASES: Final = {
    "BlockPoolError": ("RuntimeError",),
    "BlockPoolExhaustedError": ("BlockPoolError",),
    "OwnerAlreadyActiveError": ("BlockPoolError",),
    "InvalidFreeError": ("BlockPoolError", "ValueError"),
}
#: Raw PoolConfig fields the validation check tries (each against ``model.make_config``).
CONFIG_CASES: Final[tuple[dict[str, object], ...]] = (
    {},
    {"n_blocks": 0},
    {"n_blocks": 0, "grow_on_exhaustion": True},
    {"n_blocks": 8, "max_blocks": 2},
    {"n_blocks": 8, "max_blocks": 2, "grow_on_exhaustion": True},
    {"block_size": 0},
    {"n_blocks": -1},
    {"block_size": True},
    {"block_size": 1.0},
    {"n_blocks": "8"},
    {"separate_kv": 1},
    {"grow_on_exhaustion": None},
    {"max_blocks": "2"},
    {"max_blocks": True, "grow_on_exhaustion": True},
)


def _pool_line(port: Port, config: model.SpecConfig) -> str:
    shown = f"block_size={config.block_size}, n_blocks={config.n_blocks}"
    if port.config_class is None:
        return f"pool = {port.name}({shown})"
    return f"pool = {port.name}({getattr(port.config_class, '__name__', 'PoolConfig')}({shown}))"


def _finding(
    port: Port, rule: str, where: tuple[str, str], values: tuple[object, object], *lines: str
) -> Finding:
    """A finding of ``rule`` at ``where`` (check, field), ``values`` (pool's, spec's)."""
    (check, field), (actual, expected) = where, values
    return Finding(rule, check, field, actual, expected, python=(_pool_line(port, SMALL), *lines))


def check_names(port: Port) -> list[Finding]:
    """Every public name of docs/API.md that the port offers, on the pool, stats and blocks."""
    pool = port.build(SMALL)
    found: list[Finding] = []
    for declaration in declarations():
        if declaration.name not in port.offered:
            continue
        target: object = pool
        for attribute in declaration.path:
            try:
                target = getattr(target, attribute)
            except AttributeError:
                text = ".".join(("pool", *declaration.path))
                found.append(
                    _finding(
                        port,
                        "C-NAMES",
                        (declaration.name, attribute),
                        ("missing", "present"),
                        f"{text}  # AttributeError",
                    )
                )
                break
            except Exception:  # the name is there; what reading it raises, sequences report
                break
    stats = getattr(pool, "stats", None)
    for name in model.STATS_FIELDS:
        if stats is not None and not hasattr(stats, name):
            found.append(
                _finding(
                    port,
                    "C-NAMES",
                    ("stats", name),
                    ("missing", "present"),
                    f"pool.stats.{name}  # AttributeError",
                )
            )
    try:
        block = pool.allocate("k", 1, 0)[0]
    except Exception:  # the sequences report a failing allocate
        return found
    for name in HANDLE_FIELDS:
        if not hasattr(block, name):
            found.append(
                _finding(
                    port,
                    "C-NAMES",
                    ("block", name),
                    ("missing", "present"),
                    "b = pool.allocate('k', 1, 0)[0]",
                    f"b.{name}  # AttributeError",
                )
            )
    return found


def check_stats_snapshot(port: Port) -> list[Finding]:
    """``stats`` and history entries do not change after the call that returned them."""
    pool = port.build(SMALL, DEFAULT_HISTORY_LEN)
    found: list[Finding] = []
    try:
        stats = pool.stats
        seen = stats_values(stats)
        pool.allocate("k", 1, 0)
        entry = pool.history[-1]
        entry_seen = stats_values(entry)
        after = stats_values(stats)
        pool.allocate("k", 1, 0)
        entry_after = stats_values(entry)
    except Exception:  # missing names are check_names' findings; the rest, the sequences'
        return []
    if after != seen:
        field, a, b = _differing(after, seen)
        found.append(
            _finding(
                port,
                "C-STATS-SNAPSHOT",
                ("stats", field),
                (a, b),
                "stats = pool.stats",
                "pool.allocate('k', 1, 0)",
                f"stats.{field}  # pool: {a!r}; spec: {b!r} (a snapshot does not change)",
            )
        )
    if entry_after != entry_seen:
        field, a, b = _differing(entry_after, entry_seen)
        found.append(
            _finding(
                port,
                "C-STATS-SNAPSHOT",
                ("history", field),
                (a, b),
                "pool.allocate('k', 1, 0)",
                "entry = pool.history[-1]",
                "pool.allocate('k', 1, 0)",
                f"entry.{field}  # pool: {a!r}; spec: {b!r} (a snapshot does not change)",
            )
        )
    return found


def _differing(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[str, float, float]:
    for name, x, y in zip(model.STATS_FIELDS, a, b, strict=True):
        if x != y:
            return name, x, y
    raise AssertionError("called with equal values")


def _metric_types() -> dict[str, str]:
    """Metric suffix -> its Prometheus type, from the spec's samples."""
    state = model.new_pool(SMALL, 0)
    assert not isinstance(state, model.Err), "a small pool"
    samples = prometheus_samples(state, "p")
    assert not isinstance(samples, model.Err), "a valid prefix"
    return {name[2:]: "counter" if name.endswith("_total") else "gauge" for name, _ in samples}


def check_prometheus(port: Port) -> list[Finding]:
    """The exposition text (default and another prefix): HELP, TYPE, prefix, newline, parse.

    One finding per kind of problem (``# HELP`` lines, ``# TYPE`` lines, ...), naming
    the metrics it concerns.
    """
    pool = port.build(SMALL)
    problems: dict[str, list[tuple[str, object, object]]] = {}
    calls: dict[str, str] = {}
    for prefix in (DEFAULT_PROMETHEUS_PREFIX, "vq:pool_2"):
        given = "" if prefix == DEFAULT_PROMETHEUS_PREFIX else repr(prefix)
        call = f"pool.stats.to_prometheus({given})"
        try:
            text = pool.stats.to_prometheus(prefix)
        except Exception as error:  # any error is the finding
            problems.setdefault("call", []).append(
                (prefix, f"raises {type(error).__name__}", "text")
            )
            calls.setdefault("call", call)
            continue
        for kind, name, actual, expected in _prometheus_problems(text, prefix):
            problems.setdefault(kind, []).append((name, actual, expected))
            calls.setdefault(kind, call)
    found = []
    for kind, listed in problems.items():
        names = [name for name, _, _ in listed]
        _, actual, expected = listed[0]
        shown = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
        found.append(
            _finding(
                port,
                "C-PROMETHEUS",
                ("to_prometheus", kind),
                (actual, expected),
                f"print({calls[kind]})  # {kind}: {shown}: pool {actual}; spec {expected}",
            )
        )
    return found


def _prometheus_problems(text: object, prefix: str) -> Iterator[tuple[str, str, object, object]]:
    """``(kind, where, pool's, spec's)`` for each way ``text`` misses C-PROMETHEUS."""
    if not isinstance(text, str):
        yield "type", "text", type(text).__name__, "str"
        return
    if not text.endswith("\n"):
        yield "final newline", "text", "missing", "present"
    types = {m.group(1): m.group(2) for m in map(_TYPE_LINE.match, text.splitlines()) if m}
    helps = {m.group(1) for m in map(_HELP_LINE.match, text.splitlines()) if m}
    for suffix, kind in _metric_types().items():
        name = f"{prefix}_{suffix}"
        if name not in helps:
            yield "HELP lines", name, "missing", "present"
        if types.get(name) != kind:
            yield "TYPE lines", name, types.get(name, "missing"), kind
    try:
        parse_prometheus(text)
    except ValueError as error:
        yield "parses", "text", f"rejected: {error}", "parses"


def check_error_classes(port: Port) -> list[Finding]:
    """The contract's four error classes exist (where ``errors`` says) with their bases."""
    pool = port.build(SMALL)
    classes = port.error_classes(pool)
    found: list[Finding] = []
    builtin = {"RuntimeError": RuntimeError, "ValueError": ValueError}
    where = "the errors given" if port.errors is not None else f"module {type(pool).__module__}"
    for name, bases in ERROR_BASES.items():
        cls = classes[name]
        if cls is None:
            found.append(
                Finding(
                    "C-ERROR-CLASSES",
                    "errors",
                    name,
                    "missing",
                    "present",
                    python=(f"# {where} defines no {name}",),
                )
            )
            continue
        for base_name in bases:
            base = builtin.get(base_name) or classes.get(base_name)
            if base is not None and not issubclass(cls, base):
                found.append(
                    Finding(
                        "C-ERROR-CLASSES",
                        "errors",
                        f"{name} bases",
                        cls.__mro__[1].__name__,
                        base_name,
                        python=(f"issubclass({name}, {base_name})  # pool: False",),
                    )
                )
    return found


def check_config_validation(port: Port) -> list[Finding]:
    """The port's config accepts and rejects what the spec's ``make_config`` does."""
    found: list[Finding] = []
    make: Callable[..., object] = port.make_config if port.config_class else port.factory
    shown = getattr(port.config_class, "__name__", port.name)
    for case in CONFIG_CASES:
        predicted = model.make_config(**case)
        try:
            make(**case)
            actual = "accepted"
        except (TypeError, ValueError) as error:
            actual = f"raises {type(error).__name__}"
        expected = (
            f"raises {predicted.kind.value}" if isinstance(predicted, model.Err) else "accepted"
        )
        if actual != expected:
            rule = _config_rule(case, predicted)
            arguments = ", ".join(f"{k}={v!r}" for k, v in case.items())
            found.append(
                Finding(
                    rule,
                    "config",
                    arguments or "defaults",
                    actual,
                    expected,
                    python=(f"{shown}({arguments})  # pool: {actual}; spec: {expected}",),
                )
            )
    return found


def _config_rule(case: dict[str, object], predicted: object) -> str:
    if not isinstance(predicted, model.Err):
        if case.get("n_blocks") == 0:
            return "C-CONFIG-EMPTY"
        return "C-CONFIG-MAX-IGNORED" if "max_blocks" in case else "C-NAMES"
    return "C-CONFIG-TYPES" if predicted.kind is model.ErrorKind.TYPE else "C-CONFIG-VALUES"


def check_default_history(port: Port) -> list[Finding]:
    """Without ``history_len`` a pool keeps 1024 snapshots, the spec's (C-HISTORY)."""
    config = model.SpecConfig(block_size=2, n_blocks=2, separate_kv=False)
    rounds = DEFAULT_HISTORY_LEN // 2 + 4  # two counted calls each: the history overflows

    def default_length(pool_config: Any, history_len: int) -> Any:
        return port.build(pool_config)  # the factory's own default

    # The adapter hands port.build a config with the five fields as attributes, whatever
    # the port's config_class (None gives plain values, which build cannot read).
    adapter = replace(port, factory=default_length, config_class=PoolConfig)
    lockstep = Lockstep(adapter, config, DEFAULT_HISTORY_LEN, check=Check.OUTCOMES)
    try:
        for _ in range(rounds):
            lockstep.apply(Allocate("k", 1, 0))
            lockstep.apply(FreeAll(0))
        lockstep.compare_observations()
    except ConformanceError as error:
        finding = finding_from_error(error, "default history")
        loop = f"for _ in range({rounds}): pool.allocate('k', 1, 0); pool.free_all(0)"
        text = f"pool = {port.name}({_config_call(port, config)})"
        where = "pool.history" if finding.discrepancy is None else _history_read(port, finding)
        return [replace(finding, calls=(), python=(text, loop, where))]
    return []


def _config_call(port: Port, config: model.SpecConfig) -> str:
    shown = f"block_size={config.block_size}, n_blocks={config.n_blocks}, separate_kv=False"
    if port.config_class is None:
        return shown
    return f"{getattr(port.config_class, '__name__', 'PoolConfig')}({shown})"


def _history_read(port: Port, finding: Finding) -> str:
    discrepancy = finding.discrepancy
    assert discrepancy is not None, "an observation that differs"
    if discrepancy.kind == "observation":
        return read_line(port, discrepancy)
    return f"# {finding.detail.splitlines()[0]}"


def bad_argument_calls(port: Port) -> Iterator[Finding]:
    """Each bad value of each argument, in one call on a fresh pool holding one block."""
    for config in (SMALL, replace(SMALL, separate_kv=False)):
        for declaration in declarations():
            if declaration.name not in port.offered:
                continue
            for index, parameter in enumerate(declaration.parameters):
                if parameter.kind is not ArgKind.VALUE:
                    continue
                for bad in declaration.domains[parameter.name].bad(config):
                    finding = _one_bad_call(port, config, declaration, index, bad)
                    if finding is not None:
                        yield finding


def _one_bad_call(
    port: Port, config: model.SpecConfig, declaration: Declaration, index: int, bad: object
) -> Finding | None:
    values: list[object] = []
    for parameter in declaration.parameters:
        if parameter.kind is ArgKind.VALUE:
            values.append(declaration.domains[parameter.name].small(config)[0])
        elif parameter.kind is ArgKind.HANDLE:
            values.append(Handle(0, 0))
        else:
            values.append((Handle(0, 0),))
    values[index] = bad
    try:
        lockstep = Lockstep(port, config, DEFAULT_HISTORY_LEN)
        lockstep.apply(Allocate("k", 1, 0))
        lockstep.apply(declaration.op(*values))
    except ConformanceError as error:
        return finding_from_error(error, "bad arguments")
    return None


#: Every check outside sequences, in the order a report runs them.
SURFACE_CHECKS: Final = (
    check_names,
    check_error_classes,
    check_config_validation,
    check_stats_snapshot,
    check_prometheus,
    check_default_history,
)
