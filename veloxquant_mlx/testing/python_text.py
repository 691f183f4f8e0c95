"""A finding's calls as Python a reader pastes: the port's own calls, handles as variables.

``Allocate('k', 3, 0)`` labelled 2 becomes ``b2 = pool.allocate('k', 3, 0)``,
the handle ``h(2, 1)`` becomes ``b2[1]``, a block built by hand ``Block(0)``,
another pool's block ``other.allocate('k', 1, 0)[0]``; a call the spec
expects to raise is wrapped in ``with suppress(...)``, so the text runs to its
last line, which reads the value that differs and says both values.

Complexity: O(calls), plus replaying them on the spec. Thread safety: pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING

from veloxquant_mlx.testing.differences import Discrepancy
from veloxquant_mlx.testing.port import CONFIG_DEFAULTS, CONFIG_FIELDS, Port
from veloxquant_mlx.testing.sides import SpecSide, shown
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.model import ForeignBlock, NotABlock, NotAList
from veloxquant_mlx_spec.table import (
    ArgKind,
    AsTuple,
    Handle,
    Outcome,
    Raised,
    Returned,
    declaration_of,
)

__all__ = ["as_python", "read_line", "said"]

#: The other pool whose live blocks stand for another pool's handles.
OTHER_POOL = {"block_size": 4, "n_blocks": 64}


def said(value: object, beside: object = None) -> str:
    """A compared value as a reader says it; beside the other side's value, a number of
    another type says its type (``returns 1 (int)`` beside ``returns True``)."""
    if isinstance(value, Raised):
        return f"raises {value.kind}"
    if isinstance(value, Returned):
        other = beside.value if isinstance(beside, Returned) else None
        return "returns None" if value.value is None else f"returns {shown(value.value, other)}"
    return shown(value, beside)


def _config(port: Port, fields: dict[str, object]) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in fields.items() if CONFIG_DEFAULTS[k] != v)
    if port.config_class is None:
        return shown
    return f"{getattr(port.config_class, '__name__', 'PoolConfig')}({shown})"


class _Writer:
    """Names for the references of one sequence."""

    def __init__(self, port: Port) -> None:
        self.port = port
        self.block = getattr(port.block_class, "__name__", "Block")
        self.uses_other = False

    def ref(self, value: object) -> str:
        if isinstance(value, Handle):
            return f"b{value.call}[{value.position}]"
        if isinstance(value, ForeignBlock):
            if value.owner is None:
                return f"{self.block}(0)"
            self.uses_other = True
            return f"other.allocate('k', 1, {value.owner})[0]"
        if isinstance(value, NotABlock):
            return "'not a block'"
        return repr(value)

    def argument(self, kind: ArgKind, value: object) -> str:
        if kind is ArgKind.VALUE:
            return repr(value)
        if kind is ArgKind.HANDLE:
            return self.ref(value)
        if isinstance(value, NotAList):
            return f"{self.block}(0)"
        if isinstance(value, AsTuple):
            items = ", ".join(map(self.ref, value.refs))
            return f"({items},)" if len(value.refs) == 1 else f"({items})"
        assert isinstance(value, tuple), "a list of handles"
        return f"[{', '.join(map(self.ref, value))}]"

    def call(self, op: object) -> str:
        """``pool.allocate('k', 3, 0)``: trailing defaults left out."""
        declaration = declaration_of(op)
        arguments = [
            (p, v) for p, v in zip(declaration.parameters, declaration.arguments(op), strict=True)
        ]
        while arguments and arguments[-1][0].default is not MISSING:
            parameter, value = arguments[-1]
            if parameter.default != value:
                break
            arguments.pop()
        target = ".".join(("pool", *declaration.path))
        if declaration.is_property:
            return target
        shown = ", ".join(self.argument(p.kind, v) for p, v in arguments)
        return f"{target}({shown})"


def _observed(writer: _Writer, discrepancy: Discrepancy) -> str:
    """The expression that reads the value that differs."""
    where, name = discrepancy.where, discrepancy.field
    if isinstance(where, Handle):
        return f"{writer.ref(where)}.{name}"
    text = writer.call(where)
    if name.startswith("["):  # a history entry
        index, _, attribute = name.partition(".")
        return f"{text}{index}.{attribute}" if attribute else f"{text}{index}"
    if name == "len":
        return f"len({text})"
    if name in ("blocks_in_use", "fragmentation"):
        return f"{text}.{name}()"
    return f"{text}.{name}" if name else text


def _read_line(writer: _Writer, discrepancy: Discrepancy) -> str:
    return f"{_observed(writer, discrepancy)}  # {_both_sides(discrepancy)}"


def _both_sides(discrepancy: Discrepancy, pool: str = "pool") -> str:
    """``pool: returns 1 (int); spec: returns True (bool)``."""
    actual, predicted = discrepancy.actual, discrepancy.predicted
    return f"{pool}: {said(actual, predicted)}; spec: {said(predicted, actual)}"


def read_line(port: Port, discrepancy: Discrepancy) -> str:
    """The line that reads an observation that differs, with both values."""
    return _read_line(_Writer(port), discrepancy)


def as_python(
    port: Port,
    calls: Sequence[object],
    config: model.SpecConfig,
    history_len: int,
    discrepancy: Discrepancy | None,
) -> list[str]:
    """The lines that build the pool, make ``calls`` and read what differs.

    ``calls`` are labelled 0, 1, ... in order; the last one is the one the
    discrepancy showed at (its outcome, or an observation after it).
    """
    writer = _Writer(port)
    fields = {name: getattr(config, name) for name in CONFIG_FIELDS}
    extra = f", history_len={history_len}" if history_len != 1024 else ""
    lines = [f"pool = {port.name}({_config(port, fields)}{extra})"]
    spec = _spec_side(config, history_len)
    for label, op in enumerate(calls):
        predicted = _predict(spec, op, label)
        text = writer.call(op)
        if declaration_of(op).may_issue_handles and not isinstance(predicted, Raised):
            text = f"b{label} = {text}"
        last = label == len(calls) - 1
        if last and discrepancy is not None and discrepancy.kind == "outcome":
            verb = "" if discrepancy.field == "" else f" ({discrepancy.field})"
            text += f"  # {_both_sides(discrepancy, f'pool{verb}')}"
        elif isinstance(predicted, Raised):  # the paste runs on, to the line that reads
            text = f"with suppress({predicted.kind}): {text}"
        lines.append(text)
    if discrepancy is not None and discrepancy.kind == "observation":
        lines.append(_read_line(writer, discrepancy))
    if writer.uses_other:
        lines.insert(0, f"other = {port.name}({_config(port, {**CONFIG_DEFAULTS, **OTHER_POOL})})")
    if any(line.startswith("with suppress(") for line in lines):
        lines.insert(0, "from contextlib import suppress")
    return lines


def _spec_side(config: model.SpecConfig, history_len: int) -> SpecSide:
    state = model.new_pool(config, history_len)
    assert not isinstance(state, model.Err), "a finding's pool is one the spec accepts"
    return SpecSide(state)


def _predict(spec: SpecSide, op: object, label: int) -> Outcome | None:
    """The spec's outcome of ``op`` (``None`` if it names a handle no call returned)."""
    try:
        return spec.call(op, label)
    except LookupError:
        return None
