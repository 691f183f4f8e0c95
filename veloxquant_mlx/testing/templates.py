"""Small-scope calls derived from the operation table: the exhaustive and CrossHair alphabets.

A *template* is a call of the table whose handle arguments are *picks*
(:class:`Live`: the i-th live handle in checkout order; :class:`Issued`: the
i-th handle issued; :class:`FreedLast`: the handle freed last) instead of
names, so that one template applies in every state: a checker makes it
concrete with the names of the state it is in (:meth:`Template.build`).

:func:`small_scope` derives every template of a pool's configuration from
the declarations, with no per-call code:

- a call that changes the pool: its arguments' small-scope values
  (``Domain.small``; all combinations with ``combine``, else one argument at
  a time from the first) with the handle picks the checker names; then,
  from the first values, each "edge" handle (stale, foreign, built by hand,
  no block at all; for lists: the empty list, one handle twice, not a list);
- a query the lockstep runner does not already observe after every step:
  one call, with the first values; and every query gets the edge handles;
- every call: each value argument's first bad value, or all of them, wrong
  types included (or only the first argument's), the others as first.

Complexity: O(declarations x small values^arguments) at construction.
Thread safety: immutable values.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.model import ForeignBlock, NotABlock, NotAList
from veloxquant_mlx_spec.table import (
    ArgKind,
    AsTuple,
    Declaration,
    Handle,
    HandleRef,
    declaration_of,
    declarations,
    observation_ops,
)

__all__ = ["FreedLast", "Issued", "Live", "Pick", "Template", "edge_picks", "small_scope"]


@dataclass(frozen=True, slots=True)
class Live:
    """The ``index``-th live handle in checkout order (negative: counted from the newest)."""

    index: int

    def __repr__(self) -> str:
        return f"live[{self.index}]"


@dataclass(frozen=True, slots=True)
class Issued:
    """The ``index``-th handle issued, live or stale (negative: counted from the newest)."""

    index: int

    def __repr__(self) -> str:
        return "newest" if self.index == -1 else f"issued[{self.index}]"


@dataclass(frozen=True, slots=True)
class FreedLast:
    """The handle pushed onto a free list last: the one stale handle a call may still name."""

    def __repr__(self) -> str:
        return "freed last"


#: A handle argument of a template: a pick, or a reference that is no name.
Pick = Live | Issued | FreedLast | ForeignBlock | NotABlock


@dataclass(frozen=True)
class Names:
    """What a checker knows in one state: live and issued names, and the handle freed last."""

    live: Sequence[Handle]
    issued: Sequence[Handle]
    freed_last: Handle | None


def _name(pick: Pick, names: Names) -> HandleRef | None:
    """The name a pick stands for here; ``None`` if there is none."""
    if isinstance(pick, ForeignBlock | NotABlock):
        return pick
    if isinstance(pick, FreedLast):
        return names.freed_last
    pool = names.live if isinstance(pick, Live) else names.issued
    index = pick.index
    return pool[index] if -len(pool) <= index < len(pool) else None


@dataclass(frozen=True)
class Template:
    """A call with picks for handles; ``build`` names them in a state, or says it cannot."""

    declaration: Declaration
    arguments: tuple[object, ...]  # values, picks, and tuples (or AsTuple, NotAList) of picks

    def __repr__(self) -> str:
        shown = ", ".join(
            ("[" + ", ".join(map(repr, a)) + "]") if isinstance(a, tuple) else repr(a)
            for a in self.arguments
        )
        return f"{self.declaration.name}({shown})"

    def map_picks(self, bind: Callable[[Pick], Pick]) -> Template:
        """This template with every handle pick replaced by ``bind(pick)``."""
        mapped: list[object] = []
        for parameter, argument in zip(self.declaration.parameters, self.arguments, strict=True):
            if parameter.kind is ArgKind.HANDLE:
                mapped.append(bind(argument))  # type: ignore[arg-type]  # a Pick, by construction
            elif parameter.kind is ArgKind.HANDLES and isinstance(argument, AsTuple):
                mapped.append(AsTuple(tuple(map(bind, argument.refs))))  # type: ignore[arg-type]
            elif parameter.kind is ArgKind.HANDLES and isinstance(argument, tuple):
                mapped.append(tuple(map(bind, argument)))
            else:
                mapped.append(argument)
        return Template(self.declaration, tuple(mapped))

    def build(self, names: Names) -> object | None:
        """The concrete call in a state with ``names``; ``None`` where a pick names nothing."""
        built: list[object] = []
        for parameter, argument in zip(self.declaration.parameters, self.arguments, strict=True):
            if parameter.kind is ArgKind.VALUE or isinstance(argument, NotAList):
                built.append(argument)
            elif parameter.kind is ArgKind.HANDLE:
                ref = _name(argument, names)  # type: ignore[arg-type]  # a Pick, by construction
                if ref is None:
                    return None
                built.append(ref)
            else:
                picks = argument.refs if isinstance(argument, AsTuple) else argument
                assert isinstance(picks, tuple), "a list argument is a tuple of picks"
                refs = tuple(_name(pick, names) for pick in picks)
                if None in refs:
                    return None
                built.append(AsTuple(refs) if isinstance(argument, AsTuple) else refs)  # type: ignore[arg-type]
        return self.declaration.op(*built)


def edge_picks(
    kind: ArgKind, first: object, stale: Pick | None, *, junk_after_live: bool = False
) -> tuple[object, ...]:
    """The handle arguments that are no single live name: what a pool must refuse or ignore.

    ``first`` is the pick of a live handle, ``stale`` that of a freed one (``None``: none).
    With ``junk_after_live``, a list also gets each single edge handle after ``first``
    (a live handle, then a stale, foreign, hand-made or non-block item): a pool that
    checks items as it frees them frees the live one before it refuses the list.
    """
    refs: tuple[Pick, ...] = (ForeignBlock(None), ForeignBlock(0), NotABlock())
    refs = refs if stale is None else (stale, *refs)
    if kind is ArgKind.HANDLE:
        return refs
    lists: tuple[object, ...] = ((first, first), (), NotAList())
    lists = lists if stale is None else (lists[0], (stale,), *lists[1:])
    return (*lists, *((first, ref) for ref in refs)) if junk_after_live else lists


def _observed(config: model.SpecConfig) -> set[str]:
    """Names of the queries the lockstep runner compares after every step anyway."""
    return {declaration_of(op).name for op in observation_ops(config, (0,), (Handle(0, 0),))}


def small_scope(
    config: model.SpecConfig,
    *,
    handle_names: Sequence[object],
    list_names: Sequence[object],
    combine: bool,
    queries: bool = True,
    stale: Pick | None = FreedLast(),
    every_bad_argument: bool = True,
    vary_values: Callable[[Declaration], bool] | None = None,
    every_bad_value: bool = False,
    junk_after_live: bool = False,
) -> list[Template]:
    """Every template of the table for ``config`` (module docstring).

    Args:
        config: The pool.
        handle_names: The picks (:data:`Pick`) of live handles for a handle argument.
        list_names: Tuples of picks (or an ``AsTuple`` of them) for a list argument.
        combine: All combinations of the small values (exhaustive), else one argument at
            a time (CrossHair, where every letter costs).
        queries: Include queries (calls that change nothing).
        stale: The pick of a freed handle, for the edge cases (``None``: no such pick).
        every_bad_argument: A bad value for each value argument; else for the first only.
        vary_values: Which calls try more than their first value arguments (default: all);
            a call's handle arguments always take every pick.
        every_bad_value: Every bad value of the domain (wrong types too), else its first.
        junk_after_live: Lists also hold an edge handle after a live one (:func:`edge_picks`).

    Returns:
        The templates: every call's valid ones first, then the edge handles, then the
        bad values (a search meets the productive calls first).
    """
    observed = _observed(config)
    main: list[Template] = []
    edges: list[Template] = []
    bad: list[Template] = []
    for declaration in declarations():
        if not (queries or declaration.changes_state):
            continue
        choices: list[list[object]] = []
        for parameter in declaration.parameters:
            if parameter.kind is ArgKind.HANDLE:
                choices.append(list(handle_names))
            elif parameter.kind is ArgKind.HANDLES:
                choices.append(list(list_names))
            else:
                small = list(declaration.domains[parameter.name].small(config))
                varied = vary_values is None or vary_values(declaration)
                choices.append(small if varied else small[:1])
        firsts = [choice[0] for choice in choices]
        if declaration.changes_state:
            valid = _combinations(choices) if combine else _one_at_a_time(choices, firsts)
            main += [Template(declaration, arguments) for arguments in valid]
        elif declaration.name not in observed:
            main.append(Template(declaration, tuple(firsts)))
        edges += _edges(declaration, firsts, handle_names[0], stale, junk_after_live)
        values = _bad_values(declaration, firsts, config, every_bad_value)
        bad += values if every_bad_argument else values[:1]
    return _distinct([*main, *edges, *bad])


def _combinations(choices: list[list[object]]) -> Iterator[tuple[object, ...]]:
    return itertools.product(*choices)


def _one_at_a_time(
    choices: list[list[object]], firsts: list[object]
) -> Iterator[tuple[object, ...]]:
    yield tuple(firsts)
    for position, choice in enumerate(choices):
        for value in choice[1:]:
            yield (*firsts[:position], value, *firsts[position + 1 :])


def _edges(
    declaration: Declaration,
    firsts: list[object],
    first: object,
    stale: Pick | None,
    junk_after_live: bool,
) -> list[Template]:
    edges = []
    for position, parameter in enumerate(declaration.parameters):
        if parameter.kind is not ArgKind.VALUE:
            for edge in edge_picks(parameter.kind, first, stale, junk_after_live=junk_after_live):
                arguments = (*firsts[:position], edge, *firsts[position + 1 :])
                edges.append(Template(declaration, arguments))
    return edges


def _bad_values(
    declaration: Declaration, firsts: list[object], config: model.SpecConfig, every: bool
) -> list[Template]:
    """Per value argument (the others as first) its first bad value, or with ``every`` all."""
    bad = []
    for position, parameter in enumerate(declaration.parameters):
        if parameter.kind is ArgKind.VALUE:
            values = declaration.domains[parameter.name].bad(config)
            for value in values if every else values[:1]:
                arguments = (*firsts[:position], value, *firsts[position + 1 :])
                bad.append(Template(declaration, arguments))
    return bad


def _distinct(templates: list[Template]) -> list[Template]:
    seen: set[tuple[str, str]] = set()
    kept = []
    for template in templates:
        key = (template.declaration.name, repr(template.arguments))
        if key not in seen:
            seen.add(key)
            kept.append(template)
    return kept
