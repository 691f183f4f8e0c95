"""What one stress thread does: a seeded random mix of every call on the shared pool and store.

A :class:`Worker` makes one call per :meth:`Worker.step`, of a kind drawn
from the run's operation mix: any call of the operation table, or a store
write or gather. It records each (:mod:`.history`). A pool call is built
from its declaration: each value argument drawn by the worker's policy for
its domain (owners, token counts...), one of them a bad value of the domain
now and then; each handle argument from what the thread knows:

- its own owners (three per thread) and the shared owners (``0..3``, which
  every thread allocates to, frees, registers and releases, so that those
  calls race);
- the handles it was handed (live, as far as it knows), a few that went
  stale, a live handle of another pool (foreign), a hand-made ``Block``,
  and non-blocks; and, through a recorded ``blocks_for`` of a shared owner,
  handles other threads allocated, which it may free under their feet;
- the shared store: it writes a whole block of one of its own owners with a
  value no one else writes, and gathers blocks back, expecting exactly what
  it wrote. Only the owning thread writes or frees its own owners' blocks, so
  a mismatch means two live handles share storage: a **storage** violation,
  reported at once.

Handles other threads allocated are named through ``registry``
(``id(block) -> (name, block)``), which each thread fills right after the
call that handed them out returns; the runner names the ``Block`` objects a
query returned at the next barrier (:func:`named_events`), when every call
of the window has registered its handles.

Complexity: O(handles held) per step apart from the call itself and a
gather's copy of the blocks it reads. Thread safety: a worker belongs to one
thread; the registry is a plain dict, written by its allocating thread, read
by others.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator
from veloxquant_mlx.memory.storage import BlockStorage
from veloxquant_mlx.stress.config import OPERATION_KINDS, STORE_KINDS, OperationMix
from veloxquant_mlx.stress.history import ThreadRecorder
from veloxquant_mlx.stress.recording import record_call, record_unnamed_call
from veloxquant_mlx.testing.aliasing import StorageBackend, spec_config
from veloxquant_mlx.testing.store_operations import Gather, Write
from veloxquant_mlx.testing.traces import TraceLine
from veloxquant_mlx_spec.model import ForeignBlock, NotABlock, NotAList
from veloxquant_mlx_spec.operations import BlocksFor
from veloxquant_mlx_spec.table import (
    UNKNOWN_CALL,
    ArgKind,
    Declaration,
    Domain,
    Handle,
    HandleRef,
    Returned,
    Returns,
    bind,
    declaration_named,
    declaration_of,
    returned_blocks,
)

__all__ = [
    "FOREIGN_OWNER",
    "SHARED_OWNERS",
    "Registry",
    "SharedRun",
    "Worker",
    "named_events",
    "private_owners",
]

#: Owners every thread uses.
SHARED_OWNERS: Final = (0, 1, 2, 3)
#: Owners per thread that only that thread uses.
PRIVATE_OWNERS_PER_THREAD: Final = 3
#: The owner of the foreign pool's handle.
FOREIGN_OWNER: Final = 424_242

Registry = dict[int, tuple[Handle, Block]]
"""``id(block) -> (its name, the block)``, for every handle handed out and not purged."""

Held = tuple[Handle, Block]


def named_events(events: Sequence[TraceLine], registry: Registry) -> list[TraceLine]:
    """``events`` with the ``Block`` objects queries returned replaced by their names.

    Call it when every call of the events has registered its handles (at a
    barrier). A block no recorded call handed out gets ``h(UNKNOWN_CALL, id)``,
    a name the spec never predicts.
    """
    named = []
    for event in events:
        if declaration_of(event.op).returns is Returns.HANDLES and isinstance(
            event.outcome, Returned
        ):
            blocks = event.outcome.value
            assert isinstance(blocks, tuple), "a query records its list as a tuple"
            names = tuple(_name_of(block, registry) for block in blocks)
            named.append(dataclasses.replace(event, outcome=Returned(names)))
        else:
            named.append(event)
    return named


def _name_of(block: object, registry: Registry) -> Handle:
    entry = _registered(block, registry)
    return Handle(UNKNOWN_CALL, id(block)) if entry is None else entry[0]


def _registered(block: object, registry: Registry) -> Held | None:
    """``block``'s entry in ``registry``, or ``None`` (its ``id`` may be another's by now)."""
    entry = registry.get(id(block))
    return entry if entry is not None and entry[1] is block else None


def private_owners(thread: int) -> tuple[int, ...]:
    """The owners only thread ``thread`` uses."""
    base = 1000 * (thread + 1)
    return tuple(range(base, base + PRIVATE_OWNERS_PER_THREAD))


@dataclass
class SharedRun:
    """What the workers of one run share.

    Attributes:
        pool: The pool under test.
        store: The store they all write and read (``None``: no store calls).
        backend: Converts token values to and from the store's arrays.
        registry: Names of the handles handed out (see the module docstring).
        foreign_block: A live handle of another pool.
        report_violation: Called with ``(kind, message)`` when a worker sees one.
        n_threads: How many workers there are (to pick another thread's owners).
    """

    pool: BlockPoolAllocator
    store: BlockStorage[Any] | None
    backend: StorageBackend[Any] | None
    registry: Registry
    foreign_block: Block
    report_violation: Callable[[str, str], None]
    n_threads: int


class Worker:
    """One thread's calls; see the module docstring for what it calls, on what.

    Invariants: ``held[owner]`` lists (name, handle) for handles this thread
    was handed for ``owner`` and has not seen freed (another thread may have
    freed a shared owner's since); ``written[name][layer]`` is the value this
    thread last wrote to that block of one of its private owners, which is
    still held.
    """

    def __init__(
        self, index: int, shared: SharedRun, recorder: ThreadRecorder, mix: OperationMix, seed: int
    ) -> None:
        """Worker number ``index``; its choices are seeded by ``(seed, index)``."""
        self.index: Final = index
        self.shared: Final = shared
        self.recorder: Final = recorder
        self.rng: Final = random.Random(f"{seed}/{index}")
        config = shared.pool.config
        self._config: Final = spec_config(config)
        self._block_size: Final = config.block_size
        self._n_blocks: Final = max(config.n_blocks, 1)
        self._private: Final = private_owners(index)
        self.held: Final[dict[int, list[Held]]] = {
            owner: [] for owner in (*self._private, *SHARED_OWNERS)
        }
        self._stale: Final[deque[Held]] = deque(maxlen=8)
        self.written: Final[dict[Handle, dict[int, float]]] = {}
        self._hand_made: Final = Block(0)
        self._values: Final = itertools.count(1)
        weights = dict(mix.weights)
        if shared.store is None:
            weights.update(dict.fromkeys(STORE_KINDS, 0))
        self._kinds: Final = [kind for kind in OPERATION_KINDS if weights.get(kind, 0) > 0]
        self._cum_weights: Final = list(itertools.accumulate(weights[k] for k in self._kinds))
        self._store_calls: Final = {"write": self._write, "gather": self._gather}
        # How each domain's values are drawn: a run's own policy (the rest: any good value).
        self._draw: Final[dict[str, Callable[[], object]]] = {
            "owner": self._owner,
            "n_tokens": self._n_tokens,
            "target_free": lambda: self.rng.randint(0, 8),
            "n_used": lambda: self.rng.randint(0, self._block_size),
        }

    # -- driving ---------------------------------------------------------------------------

    def step(self) -> None:
        """Make one call, of a kind drawn from the mix, and record it."""
        kind = self.rng.choices(self._kinds, cum_weights=self._cum_weights)[0]
        store_call = self._store_calls.get(kind)
        if store_call is not None:
            store_call()
            return
        declaration = declaration_named(kind)
        assert declaration is not None, f"{kind} is a call of the table"
        self._call(declaration)

    def _call(self, declaration: Declaration) -> None:
        """Make one call of ``declaration`` with drawn arguments; keep the books after it."""
        objects: dict[HandleRef, object] = {}
        arguments = [
            self._argument(declaration, p.name, p.kind, objects) for p in declaration.parameters
        ]
        if self._bad():
            self._spoil(declaration, arguments)
        op = declaration.op(*arguments)
        action = bind(self.shared.pool, op, objects.__getitem__)
        invoked = record_call(self.recorder, op, action)
        result = invoked.result
        new = [
            b
            for b in returned_blocks(declaration, result)
            if isinstance(b, Block) and not self._known(b)
        ]
        if new:  # its owner: the call's owner, fork's destination, make_writable's holder
            self._received(invoked.op_id, getattr(new[0], "owner", None), new)
        if declaration.changes_state:
            self._forget_freed()

    def _argument(
        self, declaration: Declaration, name: str, kind: ArgKind, objects: dict[HandleRef, object]
    ) -> object:
        if kind is ArgKind.HANDLE:
            ref, obj = self._some_ref()
            objects[ref] = obj
            return ref
        if kind is ArgKind.HANDLES:
            refs, blocks = self._some_list()
            if refs is None:
                objects[ForeignBlock(None)] = self._hand_made  # a bare Block, not a list
                return NotAList()
            objects.update(zip(refs, blocks, strict=True))
            return refs
        domain = declaration.domains[name]
        if domain.name == "owner" and not declaration.changes_state:
            return self._any_owner()  # a query may look at another thread's owners
        draw = self._draw.get(domain.name)
        return draw() if draw is not None else self.rng.choice(domain.good(self._config))

    def _spoil(self, declaration: Declaration, arguments: list[object]) -> None:
        """Make one value argument a bad value of its domain (the call must be refused)."""
        values = [i for i, p in enumerate(declaration.parameters) if p.kind is ArgKind.VALUE]
        if values:
            index = self.rng.choice(values)
            domain: Domain = declaration.domains[declaration.parameters[index].name]
            arguments[index] = self.rng.choice(domain.bad(self._config))

    # -- choosing arguments ----------------------------------------------------------------

    def _owner(self) -> int:
        if self.rng.random() < 0.7:
            return self.rng.choice(self._private)
        return self.rng.choice(SHARED_OWNERS)

    def _any_owner(self) -> int:
        other = private_owners(self.rng.randrange(self.shared.n_threads))
        return self.rng.choice([*SHARED_OWNERS, *other])

    def _n_tokens(self) -> int:
        if self.rng.random() < 0.08:  # large: exhaustion and growth
            return self._block_size * self.rng.randint(
                self._n_blocks // 4 + 1, self._n_blocks // 2 + 1
            )
        return self.rng.randint(1, 2 * self._block_size)

    def _bad(self) -> bool:
        return self.rng.random() < 0.04

    def _held_pairs(self) -> list[Held]:
        return [pair for pairs in self.held.values() for pair in pairs]

    def _some_ref(self) -> tuple[HandleRef, object]:
        """A handle reference of any kind, and the object it stands for."""
        roll = self.rng.random()
        held = self._held_pairs()
        if roll < 0.6 and held:
            return self.rng.choice(held)
        if roll < 0.75 and self._stale:
            return self.rng.choice(self._stale)
        if roll < 0.85:
            return ForeignBlock(FOREIGN_OWNER), self.shared.foreign_block
        if roll < 0.95:
            return ForeignBlock(None), self._hand_made
        return NotABlock(), "not a block"

    def _some_list(self) -> tuple[tuple[HandleRef, ...] | None, list[object]]:
        """Some of one owner's handles, some of a shared owner's, or a bad list (None: none)."""
        roll = self.rng.random()
        if roll < 0.6:
            owners = [owner for owner, pairs in self.held.items() if pairs]
            pairs = self.held[self.rng.choice(owners)] if owners else []
        elif roll < 0.75:
            pairs = self._others_blocks()
        else:
            return self._bad_list()
        chosen = self.rng.sample(pairs, self.rng.randint(1, len(pairs))) if pairs else []
        return tuple(name for name, _ in chosen), [block for _, block in chosen]

    def _others_blocks(self) -> list[Held]:
        """A shared owner's handles, whoever was handed them, through a recorded blocks_for."""
        op = BlocksFor(self.rng.choice(SHARED_OWNERS))
        result = record_unnamed_call(self.recorder, self.shared.pool, op).result
        blocks: list[Block] = [] if isinstance(result, Exception) else result  # type: ignore[assignment]
        entries = [_registered(block, self.shared.registry) for block in blocks]
        return [entry for entry in entries if entry is not None]

    def _bad_list(self) -> tuple[tuple[HandleRef, ...] | None, list[object]]:
        """A list that must be refused, or free nothing: stale, repeated, foreign, empty..."""
        held = self._held_pairs()
        names: list[HandleRef] = []
        blocks: list[object] = []
        if held:
            name, block = self.rng.choice(held)
            names, blocks = [name], [block]
        roll = self.rng.random()
        if roll < 0.2:
            return (), []  # free([]) is a no-op
        if roll < 0.4 and names:
            return (names[0], names[0]), blocks * 2  # the same handle twice
        if roll < 0.9:
            ref, obj = self._some_ref()
            order = [*zip([*names, ref], [*blocks, obj], strict=True)]
            self.rng.shuffle(order)
            return tuple(ref for ref, _ in order), [obj for _, obj in order]
        return None, []  # a bare Block where a list belongs

    # -- bookkeeping -------------------------------------------------------------------------

    def _known(self, block: object) -> bool:
        """Whether ``block`` was named already (make_writable may return its argument)."""
        return _registered(block, self.shared.registry) is not None

    def _received(self, op_id: int, owner: object, blocks: list[Block]) -> None:
        """Name the handles a call handed out, for every thread; hold them if the owner is ours."""
        named = [(Handle(op_id, i), block) for i, block in enumerate(blocks)]
        registry = self.shared.registry
        for name, block in named:
            registry[id(block)] = (name, block)
        if isinstance(owner, int) and owner in self.held:
            self.held[owner].extend(named)

    def _forget_freed(self) -> None:
        """Handles that show no owner any more (freed, here or by another thread) go stale."""
        for owner, pairs in self.held.items():
            if any(block.owner is None for _, block in pairs):
                for name, block in pairs:
                    if block.owner is None:
                        self._stale.append((name, block))
                        self.written.pop(name, None)
                self.held[owner] = [pair for pair in pairs if pair[1].owner is not None]

    # -- the shared store ----------------------------------------------------------------------

    def _write(self) -> None:
        store, backend = self.shared.store, self.shared.backend
        assert store is not None and backend is not None, "write is only drawn with a store"
        rng = self.rng
        through_stale = rng.random() < 0.05 and bool(self._stale)  # must be refused
        own = [pair for owner in self._private for pair in self.held[owner]]
        if not (own or through_stale):
            return
        name, block = rng.choice(self._stale) if through_stale else rng.choice(own)
        layer = rng.randrange(store.n_layers)
        value = float((next(self._values) * self.shared.n_threads + self.index) % 2**24)
        shape = (self._block_size, *store.slot_shape)
        tokens = backend.from_numpy(np.full(shape, value, dtype=np.float32))
        op = Write(layer, name, 0, self._block_size)
        result = record_call(self.recorder, op, lambda: store.write(layer, block, 0, tokens)).result
        if not isinstance(result, Exception) and not through_stale:
            self.written.setdefault(name, {})[layer] = value

    def _gather(self) -> None:
        store, backend = self.shared.store, self.shared.backend
        assert store is not None and backend is not None, "gather is only drawn with a store"
        rng = self.rng
        layer = rng.randrange(store.n_layers)
        held = {name: block for owner in self._private for name, block in self.held[owner]}
        readable = [n for n, layers in self.written.items() if layer in layers and n in held]
        if not readable:
            return
        names = rng.sample(readable, min(len(readable), rng.randint(1, 3)))
        blocks = [held[name] for name in names]
        n_tokens = len(blocks) * self._block_size
        op = Gather(layer, tuple(names), n_tokens)
        result = record_call(
            self.recorder, op, lambda: backend.to_numpy(store.gather(layer, blocks, n_tokens))
        ).result
        if isinstance(result, Exception):
            return
        size = self._block_size
        for position, (name, block) in enumerate(zip(names, blocks, strict=True)):
            got = result[position * size : (position + 1) * size]
            expected = self.written[name][layer]
            if not np.all(got == expected):
                found = sorted({float(v) for v in np.unique(got)})[:4]
                self.shared.report_violation(
                    "storage",
                    f"thread {self.index} read block id {block.block_id} (handle {name!r}, "
                    f"layer {layer}) and found {found}, but it wrote {expected} there and no "
                    "one else writes to it: two live handles share storage, or a write was lost",
                )
