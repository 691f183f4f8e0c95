"""What the exhaustive checker explores: the pools, the letters, the probes, the dedup key.

Used by :mod:`~veloxquant_mlx.testing.exhaustive` (the search) and the
conformance report. The alphabet (:func:`alphabet`) is derived from the
operation table by :func:`~veloxquant_mlx.testing.templates.small_scope`:
every call that changes the pool with its small-scope values, every handle
shape (each junk item after a live one inside ``free()``'s list too), and
every bad value of every argument, wrong types included. :func:`probe` lists
the calls that bring to light what a pool holds but does not show;
:func:`canonical_key` is when two states are the same for every future
observation (its rules are in :mod:`~veloxquant_mlx.testing.exhaustive`).

Complexity: :func:`alphabet` O(declarations x small values^arguments), once
per scope; :func:`probe` O(owners + streams); :func:`canonical_key` O(handles
log handles). Thread safety: pure functions of immutable values.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.testing.port import Port
from veloxquant_mlx.testing.templates import Live, Template, small_scope
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.operations import Allocate, BlockPool, RegisterOwner
from veloxquant_mlx_spec.table import ArgKind, AsTuple, Handle, declaration_of

__all__ = [
    "FORMAT_OF_OWNER",
    "OWNERS",
    "PROFILE_DEPTHS",
    "SCOPES",
    "Scope",
    "alphabet",
    "canonical_key",
    "default_factory",
    "freed_last",
    "port_scope",
    "probe",
]

OWNERS = (0, 1)
#: Each owner allocates with its own format, so that formats are checked too.
FORMAT_OF_OWNER = {0: "fp16", 1: "int4"}


@dataclass(frozen=True)
class Scope:
    """One pool to explore: a name for reports, its config and ``history_len``."""

    name: str
    config: model.SpecConfig
    history_len: int


SCOPES: tuple[Scope, ...] = (
    Scope("separate-4", model.SpecConfig(2, 4, separate_kv=True), history_len=2),
    Scope("shared-4", model.SpecConfig(2, 4, separate_kv=False), history_len=2),
    Scope("separate-grow-3-to-4", model.SpecConfig(2, 3, True, True, 4), history_len=2),
    Scope("shared-grow-0-to-3", model.SpecConfig(2, 0, False, True, 3), history_len=2),
)
#: Depth (letters per sequence) of each profile.
PROFILE_DEPTHS = {"ci": 4, "nightly": 6}


def port_scope(port: Port, scope: Scope) -> Scope:
    """``scope`` with a history length ``port``'s factory can be given (its default, if it
    takes none)."""
    return replace(scope, history_len=port.history_len_for(scope.history_len))


def default_factory(config: PoolConfig, history_len: int) -> BlockPool[Any]:
    """Our own allocator, the default system under test."""
    return BlockPoolAllocator(config, history_len=history_len)


# ---- the alphabet ------------------------------------------------------------------


def _format_follows_owner(template: Template) -> bool:
    """The exhaustive checker's own rule: owner o allocates with ``FORMAT_OF_OWNER[o]``."""
    parameters = template.declaration.parameters
    named = {p.name: a for p, a in zip(parameters, template.arguments, strict=True)}
    owner, fmt = named.get("owner"), named.get("format")
    if not (model.is_int(owner) and owner in FORMAT_OF_OWNER):
        return True  # a bad owner: the call is refused whatever the format
    return fmt not in FORMAT_OF_OWNER.values() or FORMAT_OF_OWNER[owner] == fmt


def alphabet(config: model.SpecConfig) -> tuple[Template, ...]:
    """Every letter explored on a pool of ``config``, derived from the operation table.

    Every call that changes the pool; queries are left out, since every one the
    pool answers in a state is compared after each call anyway. Live handles are
    picked by position (every position a pool of this size can fill, the newest,
    and the two newest out of order), plus the handle freed last.
    """
    max_live = max(config.n_blocks, config.max_blocks or 0)
    lists: list[tuple[object, ...] | AsTuple] = [(Live(i),) for i in range(max_live)]
    lists.append((Live(-1), Live(-2)))  # two at once, not in checkout order
    letters = small_scope(
        config,
        handle_names=(Live(0), Live(-1)),
        list_names=lists,
        combine=True,
        queries=False,
        every_bad_value=True,
        junk_after_live=True,
    )
    return tuple(letter for letter in letters if _format_follows_owner(letter))


def probe(state: model.PoolState) -> list[object]:
    """Calls that bring to light what a pool holds but does not show, at ``state``.

    ``register_owner`` of each owner holding nothing (it raises if the owner
    is registered), then per stream one allocation of every free block, which
    shows the free-list order and, through ``n_reused``, ``ever_allocated``;
    the first one also grows the pool to its cap, which shows the retired ids
    and the next id.
    """
    config = state.config
    room = 0
    if config.grow_on_exhaustion:
        n_blocks = model.stats(state).n_blocks
        room = 1 if config.max_blocks is None else config.max_blocks - n_blocks
    holding = {view.owner for view in state.handles if view.owner is not None}
    operations: list[object] = [RegisterOwner(o) for o in OWNERS if o not in holding]
    for stream, free_list in state.free_lists:
        n_blocks_wanted, room = len(free_list) + room, 0
        if n_blocks_wanted:
            owner = OWNERS[0]
            n_tokens = n_blocks_wanted * config.block_size
            operations.append(Allocate(stream, n_tokens, owner, FORMAT_OF_OWNER[owner]))
    return operations


# ---- states and their canonical key ------------------------------------------------


def canonical_key(state: model.PoolState, last_freed: model.HandleId | None) -> Hashable:
    """The dedup key: equal keys mean equal future observations, up to handle renaming.

    The module docstring explains what is kept verbatim and what is abstracted.
    """
    live = tuple(view for view in state.handles if view.owner is not None)
    holding = {view.owner for view in live}
    frozen_stale = sorted(
        (view.block_id, view.stream, view.format, view.n_used)
        for handle, view in enumerate(state.handles)
        if view.owner is None and handle != last_freed
    )
    return (
        state.free_lists,
        state.next_block_id,
        state.ever_allocated,
        state.retired,
        state.registered - holding,  # a holder's registration ends with its last block
        state.counters,
        state.history,
        live,
        None if last_freed is None else state.handles[last_freed],
        tuple(frozen_stale),
    )


def _listed(operation: object) -> list[object]:
    """The items of ``operation``'s list-of-handles arguments, in list order."""
    declaration = declaration_of(operation)
    items: list[object] = []
    arguments = declaration.arguments(operation)
    for parameter, value in zip(declaration.parameters, arguments, strict=True):
        if parameter.kind is ArgKind.HANDLES and isinstance(value, tuple | AsTuple):
            items += value.refs if isinstance(value, AsTuple) else value
    return items


def freed_last(
    before: model.PoolState,
    operation: object,
    after: model.PoolState,
    names: Sequence[Handle],
) -> model.HandleId | None:
    """The handle ``operation`` pushed onto a free list last; None if it freed none.

    A list is pushed in list order; anything else (``free_all``) in allocation order.
    """
    freed = [h for h in model.live_handles(before) if after.handles[h].owner is None]
    serial_of = {name: serial for serial, name in enumerate(names)}
    listed = [serial_of.get(item) for item in _listed(operation) if isinstance(item, Handle)]
    pushed = [serial for serial in listed if serial in freed]
    if pushed:
        return pushed[-1]
    return freed[-1] if freed else None
