"""Hypothesis strategies for the calls of the operation table, for any pool.

Arguments come from one place per operation: a value argument draws from
its domain in the table (``Domain.good``, or ``Domain.bad`` for a call made
wrong on purpose), a handle argument from the handles the run has named so
far plus the references that are not names (another pool's live block, a
block built by hand, something that is no block). Lists of handles come in
the shapes that catch allocators out: a subset of the live handles in any
order, stale or foreign items among live ones, one handle twice, a tuple,
and a bare block where a list belongs.

Requires the ``dev`` extra (Hypothesis). Complexity: O(arguments) per draw.
Thread safety: strategies are immutable.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.model import ForeignBlock, NotABlock, NotAList
from veloxquant_mlx_spec.table import (
    ArgKind,
    AsTuple,
    Declaration,
    Handle,
    HandleList,
    HandleRef,
)

__all__ = [
    "arguments_of",
    "bad_call",
    "call",
    "handle_lists",
    "handle_refs",
    "spec_configs",
]


@st.composite
def spec_configs(draw: st.DrawFn) -> model.SpecConfig:
    """Small valid pools: both stream modes, growth on/off, caps, ``n_blocks`` from 0."""
    n_blocks = draw(st.integers(0, 8))
    grow = draw(st.booleans())
    max_blocks = draw(st.one_of(st.none(), st.integers(n_blocks, n_blocks + 4)))
    config = model.make_config(
        block_size=draw(st.sampled_from([1, 2, 3, 4, 16])),
        n_blocks=n_blocks,
        separate_kv=draw(st.booleans()),
        grow_on_exhaustion=grow,
        max_blocks=max_blocks,
    )
    assert not isinstance(config, model.Err), config
    return config


def _not_names() -> st.SearchStrategy[HandleRef]:
    return st.one_of(
        st.builds(ForeignBlock, st.one_of(st.none(), st.integers(0, 2))),
        st.just(NotABlock()),
    )


def handle_refs(
    *, live: Sequence[Handle], issued: Sequence[Handle]
) -> st.SearchStrategy[HandleRef]:
    """A live handle (most often), any named handle, or a reference that is no name."""
    options: list[st.SearchStrategy[HandleRef]] = [_not_names()]
    if issued:
        options.insert(0, st.sampled_from(list(issued)))
    if live:
        options = [st.sampled_from(list(live))] * 3 + options
    return st.one_of(options)


def handle_lists(
    *, live: Sequence[Handle], issued: Sequence[Handle]
) -> st.SearchStrategy[HandleList]:
    """A list of handles in one of the shapes the module docstring lists."""
    any_refs = st.lists(handle_refs(live=live, issued=issued), max_size=4).map(tuple)
    options: list[st.SearchStrategy[HandleList]] = [
        any_refs,
        any_refs.map(AsTuple),
        st.just(NotAList()),
    ]
    if live:
        names = list(live)
        subsets = st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)
        options += [subsets.map(tuple)] * 2 + [st.sampled_from(names).map(lambda n: (n, n))]
    return st.one_of(options)


def arguments_of(
    declaration: Declaration,
    config: model.SpecConfig,
    *,
    live: Sequence[Handle],
    issued: Sequence[Handle],
) -> st.SearchStrategy[tuple[object, ...]]:
    """Valid-looking arguments of ``declaration``'s call (handles may still be stale).

    A value comes from its domain's ``small`` examples half the time, else from ``good``.
    """
    parts: list[st.SearchStrategy[object]] = []
    for parameter in declaration.parameters:
        if parameter.kind is ArgKind.HANDLE:
            parts.append(handle_refs(live=live, issued=issued))
        elif parameter.kind is ArgKind.HANDLES:
            parts.append(handle_lists(live=live, issued=issued))
        else:
            domain = declaration.domains[parameter.name]
            # Half the time one of the few values a small-scope search tries (one block,
            # two owners), so that short runs reach the states where allocators go wrong.
            small, good = domain.small(config), domain.good(config)
            parts.append(st.sampled_from(small) | st.sampled_from(good))
    return st.tuples(*parts)


def call(
    declaration: Declaration,
    config: model.SpecConfig,
    *,
    live: Sequence[Handle],
    issued: Sequence[Handle],
) -> st.SearchStrategy[object]:
    """One call of ``declaration``, its arguments drawn by :func:`arguments_of`."""
    arguments = arguments_of(declaration, config, live=live, issued=issued)
    return arguments.map(lambda values: declaration.op(*values))


def bad_call(
    declarations: Sequence[Declaration],
    config: model.SpecConfig,
    *,
    live: Sequence[Handle],
    issued: Sequence[Handle],
) -> st.SearchStrategy[object]:
    """A call with exactly one value argument from its domain's bad values."""
    candidates = [
        (declaration, index)
        for declaration in declarations
        for index, parameter in enumerate(declaration.parameters)
        if parameter.kind is ArgKind.VALUE
    ]

    @st.composite
    def draw_bad(draw: st.DrawFn) -> object:
        declaration, index = draw(st.sampled_from(candidates))
        values = list(draw(arguments_of(declaration, config, live=live, issued=issued)))
        domain = declaration.domains[declaration.parameters[index].name]
        values[index] = draw(st.sampled_from(domain.bad(config)))
        return declaration.op(*values)

    return draw_bad()
