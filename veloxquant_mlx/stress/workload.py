"""What one stress thread does: a seeded random mix of every call on the shared pool and store.

A :class:`Worker` makes one call per :meth:`Worker.step`, of a kind drawn
from the run's operation mix, and records it (:mod:`.history`). It works on:

- its own owners (three per thread) and the shared owners (``0..3``, which
  every thread allocates to, frees, registers and releases, so that those
  calls race);
- the handles it allocated (live, as far as it knows), a few it freed
  (stale), a live handle of another pool (foreign), a hand-made ``Block``,
  and non-blocks; and, through ``blocks_for`` of a shared owner, handles
  other threads allocated, which it may free under their feet;
- the shared store: it writes a whole block of one of its own owners with a
  value no one else writes, and reads blocks back, expecting exactly what it
  wrote. Only the owning thread writes or frees its own owners' blocks, so a
  mismatch means two live handles share storage: a **storage** violation,
  reported at once.

Arguments are valid most of the time and wrong now and then (a bad stream,
``n_tokens=0``, a ``bool`` owner, ``n_used`` past the block...), so every
error path runs concurrently too. Allocations are sometimes large, to drive
the pool into exhaustion and growth; ``shrink`` gives blocks back.

Handles other threads allocated are named through ``registry``
(``id(block) -> (name, block)``), which each thread fills right after its
allocate returns; the runner resolves the ``Block`` objects a
``blocks_for`` returned into names at the next barrier, when every allocate
of the window has registered its handles.

Complexity: O(1) per step apart from the call itself and a read's copy of
the blocks it reads. Thread safety: a worker belongs to one thread; the
registry is a plain dict, written by its allocating thread, read by others.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import numpy as np

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator
from veloxquant_mlx.memory.storage import BlockStorage
from veloxquant_mlx.stress.config import OPERATION_KINDS, OperationMix
from veloxquant_mlx.stress.history import (
    UNKNOWN_HANDLE,
    Allocate,
    BlocksFor,
    Call,
    Event,
    Free,
    FreeAll,
    HandleName,
    History,
    IdBound,
    IsLive,
    MarkUsed,
    NFree,
    Prometheus,
    Ref,
    RegisterOwner,
    ReleaseOwner,
    Returned,
    Shrink,
    Stats,
    StoreRead,
    StoreWrite,
    ThreadRecorder,
)
from veloxquant_mlx.stress.recording import (
    Invoked,
    parse_prometheus,
    record_call,
    stats_tuple_of,
)
from veloxquant_mlx.testing.aliasing import StorageBackend
from veloxquant_mlx_spec.model import ForeignBlock, NotABlock, NotAList

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
_FORMATS: Final = ("fp16", "int4", "int2")

Registry = dict[int, tuple[HandleName, Block]]
"""``id(block) -> (its name, the block)``, for every handle handed out and not purged."""

T = TypeVar("T")


def named_events(events: Sequence[Event], registry: Registry) -> list[Event]:
    """``events`` with the ``Block`` objects ``blocks_for`` returned replaced by their names.

    Call it when every allocate of the events has registered its handles (at a
    barrier). A block no recorded allocate made gets ``(UNKNOWN_HANDLE, id)``,
    a name the spec never predicts.
    """
    named = []
    for event in events:
        if isinstance(event.call, BlocksFor) and isinstance(event.outcome, Returned):
            blocks = event.outcome.value
            assert isinstance(blocks, tuple), "blocks_for records its list as a tuple"
            names = tuple(_name_of(block, registry) for block in blocks)
            named.append(dataclasses.replace(event, outcome=Returned(names)))
        else:
            named.append(event)
    return named


def _name_of(block: object, registry: Registry) -> HandleName:
    entry = registry.get(id(block))
    if entry is not None and entry[1] is block:
        return entry[0]
    return (UNKNOWN_HANDLE, id(block))


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
    allocated to ``owner`` and has not seen freed (another thread may have
    freed a shared owner's); ``written[name][layer]`` is the value this
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
        self._block_size: Final = config.block_size
        self._n_blocks: Final = max(config.n_blocks, 1)
        self._streams: Final = ("k", "v") if config.separate_kv else ("k", "v", "kv")
        self._private: Final = private_owners(index)
        self.held: Final[dict[int, list[tuple[HandleName, Block]]]] = {
            owner: [] for owner in (*self._private, *SHARED_OWNERS)
        }
        self._stale: Final[deque[tuple[HandleName, Block]]] = deque(maxlen=8)
        self.written: Final[dict[HandleName, dict[int, float]]] = {}
        self._hand_made: Final = Block(0)
        self._values: Final = itertools.count(1)
        weights = dict(mix.weights)
        if shared.store is None:
            weights["write"] = weights["read"] = 0
        self._kinds: Final = [kind for kind in OPERATION_KINDS if weights.get(kind, 0) > 0]
        self._cum_weights: Final = list(itertools.accumulate(weights[k] for k in self._kinds))
        self._actions: Final[dict[str, Callable[[], None]]] = {
            kind: getattr(self, f"_do_{kind}") for kind in self._kinds
        }

    @property
    def _loose_pool(self) -> Any:
        """The pool, typed loosely: calls pass ill-typed arguments on purpose."""
        return self.shared.pool

    # -- driving ---------------------------------------------------------------------------

    def step(self) -> None:
        """Make one call, of a kind drawn from the mix, and record it."""
        kind = self.rng.choices(self._kinds, cum_weights=self._cum_weights)[0]
        self._actions[kind]()

    def _invoke(
        self, call: Call, action: Callable[[], T], value_of: Callable[[T], object]
    ) -> Invoked[T]:
        return record_call(self.recorder, call, action, value_of)

    # -- choosing arguments ----------------------------------------------------------------

    def _owner(self) -> int:
        if self.rng.random() < 0.7:
            return self.rng.choice(self._private)
        return self.rng.choice(SHARED_OWNERS)

    def _bad(self) -> bool:
        return self.rng.random() < 0.04

    def _held_pairs(self) -> list[tuple[int, tuple[HandleName, Block]]]:
        return [(owner, pair) for owner, pairs in self.held.items() for pair in pairs]

    def _some_ref(self) -> tuple[Ref, object]:
        """A handle reference of any kind, and the object it stands for."""
        roll = self.rng.random()
        held = self._held_pairs()
        if roll < 0.6 and held:
            name, block = self.rng.choice(held)[1]
            return name, block
        if roll < 0.75 and self._stale:
            return self.rng.choice(self._stale)
        if roll < 0.85:
            return ForeignBlock(FOREIGN_OWNER), self.shared.foreign_block
        if roll < 0.95:
            return ForeignBlock(None), self._hand_made
        return NotABlock(), "not a block"

    def _forget(self, owner: int, names: set[HandleName]) -> None:
        """These handles are freed: move them from ``held`` to the stale handles."""
        kept = []
        for name, block in self.held.get(owner, []):
            if name in names:
                self._stale.append((name, block))
                self.written.pop(name, None)
            else:
                kept.append((name, block))
        self.held[owner] = kept

    # -- pool calls that change state --------------------------------------------------------

    def _do_allocate(self) -> None:
        rng = self.rng
        owner: object = self._owner()
        stream: object = rng.choice(self._streams)
        n_tokens: object = rng.randint(1, 2 * self._block_size)
        if rng.random() < 0.08:  # large: exhaustion and growth
            n_tokens = self._block_size * rng.randint(
                self._n_blocks // 4 + 1, self._n_blocks // 2 + 1
            )
        fmt: object = rng.choice(_FORMATS)
        if self._bad():
            field, value = rng.choice(
                [
                    ("n_tokens", 0),
                    ("n_tokens", True),
                    ("n_tokens", 2.5),
                    ("stream", "x"),
                    ("owner", "seven"),
                    ("owner", True),
                    ("format", ""),
                    ("format", 7),
                ]
            )
            stream, n_tokens, owner, fmt = {
                "stream": (value, n_tokens, owner, fmt),
                "n_tokens": (stream, value, owner, fmt),
                "owner": (stream, n_tokens, value, fmt),
                "format": (stream, n_tokens, owner, value),
            }[field]
        pool = self._loose_pool

        def allocate() -> list[Block]:
            blocks: list[Block] = pool.allocate(stream, n_tokens, owner, fmt)
            return blocks

        invoked = self._invoke(Allocate(stream, n_tokens, owner, fmt), allocate, _block_ids)
        if isinstance(invoked.result, Exception):
            return
        named = [((invoked.op_id, i), block) for i, block in enumerate(invoked.result)]
        registry = self.shared.registry
        for name, block in named:
            registry[id(block)] = (name, block)
        if isinstance(owner, int) and owner in self.held:
            self.held[owner].extend(named)

    def _do_free(self) -> None:
        roll = self.rng.random()
        if roll < 0.6:
            self._free_own()
        elif roll < 0.75:
            self._free_others()
        else:
            self._free_invalid()

    def _free_own(self) -> None:
        owners = [owner for owner, pairs in self.held.items() if pairs]
        if not owners:
            return
        owner = self.rng.choice(owners)
        pairs = self.held[owner]
        chosen = self.rng.sample(pairs, self.rng.randint(1, len(pairs)))
        if (
            self._free([name for name, _ in chosen], [block for _, block in chosen])
            or owner in SHARED_OWNERS
        ):
            self._forget(owner, {name for name, _ in chosen})

    def _free_others(self) -> None:
        """Free some of a shared owner's blocks, whoever allocated them."""
        owner = self.rng.choice(SHARED_OWNERS)
        blocks = self._blocks_for(owner)
        registry = self.shared.registry
        known = []
        for block in blocks:
            entry = registry.get(id(block))
            if entry is not None and entry[1] is block:
                known.append(entry)
        if not known:
            return
        chosen = self.rng.sample(known, self.rng.randint(1, len(known)))
        if self._free([name for name, _ in chosen], [block for _, block in chosen]):
            self._forget(owner, {name for name, _ in chosen})

    def _free_invalid(self) -> None:
        """A free that must fail, or be a no-op: stale, repeated, foreign, empty, not a list."""
        rng = self.rng
        held = self._held_pairs()
        names: list[Ref] = []
        blocks: list[object] = []
        if held:
            name, block = rng.choice(held)[1]
            names.append(name)
            blocks.append(block)
        roll = rng.random()
        if roll < 0.2:
            names, blocks = [], []  # free([]) is a no-op
        elif roll < 0.4 and names:
            names, blocks = names * 2, blocks * 2  # the same handle twice
        elif roll < 0.9:
            ref, obj = self._some_ref()
            names.append(ref)
            blocks.append(obj)
            rng.shuffle(order := list(range(len(names))))
            names, blocks = [names[i] for i in order], [blocks[i] for i in order]
        else:
            pool = self._loose_pool
            hand_made = self._hand_made
            self._invoke(Free(NotAList()), lambda: pool.free(hand_made), _nothing)
            return
        if self._free(names, blocks):  # two live handles of this thread: it freed them
            freed = {ref for ref in names if isinstance(ref, tuple)}
            for owner in self.held:
                self._forget(owner, freed)

    def _free(self, names: Sequence[Ref], blocks: Sequence[object]) -> bool:
        """Record ``free(blocks)``; whether it succeeded."""
        pool = self._loose_pool
        as_list = list(blocks)
        result = self._invoke(
            Free(tuple(names)),
            lambda: pool.free(as_list),
            _nothing,
        ).result
        return not isinstance(result, Exception)

    def _do_free_all(self) -> None:
        owner: object = self._owner()
        if self._bad():
            owner = "seven"
        pool = self._loose_pool
        result = self._invoke(FreeAll(owner), lambda: pool.free_all(owner), _nothing).result
        if not isinstance(result, Exception) and isinstance(owner, int):
            self._forget(owner, {name for name, _ in self.held[owner]})

    def _do_shrink(self) -> None:
        stream: object = self.rng.choice(self._streams)
        target: object = self.rng.randint(0, 8)
        if self._bad():
            stream, target = self.rng.choice([("z", target), (stream, -1), (stream, "2")])
        pool = self._loose_pool
        self._invoke(
            Shrink(stream, target),
            lambda: pool.shrink(stream, target),
            _same,
        )

    def _do_mark_used(self) -> None:
        ref, obj = self._some_ref()
        n_used: object = self.rng.randint(0, self._block_size)
        if self._bad():
            n_used = self.rng.choice([self._block_size + 1, -1, "3"])
        pool = self._loose_pool
        self._invoke(
            MarkUsed(ref, n_used),
            lambda: pool.mark_used(obj, n_used),
            _nothing,
        )

    def _do_register_owner(self) -> None:
        owner: object = "seven" if self._bad() else self._owner()
        pool = self._loose_pool
        self._invoke(RegisterOwner(owner), lambda: pool.register_owner(owner), _nothing)

    def _do_release_owner(self) -> None:
        owner: object = "seven" if self._bad() else self._owner()
        pool = self._loose_pool
        self._invoke(ReleaseOwner(owner), lambda: pool.release_owner(owner), _nothing)

    # -- read-only pool calls ------------------------------------------------------------------

    def _do_stats(self) -> None:
        pool = self.shared.pool
        self._invoke(Stats(), lambda: pool.stats, stats_tuple_of)

    def _do_prometheus(self) -> None:
        pool = self.shared.pool
        # The lambda keeps the snapshot inside the timed call.
        self._invoke(Prometheus(), lambda: pool.stats.to_prometheus(), parse_prometheus)  # noqa: PLW0108

    def _do_history(self) -> None:
        pool = self.shared.pool
        self._invoke(
            History(),
            lambda: pool.history,
            lambda history: tuple(stats_tuple_of(stats) for stats in history),
        )

    def _do_n_free(self) -> None:
        stream: object = "z" if self._bad() else self.rng.choice(self._streams)
        pool = self._loose_pool
        self._invoke(NFree(stream), lambda: pool.n_free(stream), _same)

    def _do_blocks_for(self) -> None:
        owner = self.rng.choice(
            [*SHARED_OWNERS, *private_owners(self.rng.randrange(self.shared.n_threads))]
        )
        self._blocks_for(owner)

    def _blocks_for(self, owner: object) -> list[Block]:
        """Record ``blocks_for(owner)`` (the blocks are named at the next barrier)."""
        pool = self._loose_pool

        def blocks_for() -> list[Block]:
            blocks: list[Block] = pool.blocks_for(owner)
            return blocks

        result = self._invoke(BlocksFor(owner), blocks_for, tuple).result
        return [] if isinstance(result, Exception) else result

    def _do_is_live(self) -> None:
        ref, obj = self._some_ref()
        pool = self._loose_pool
        self._invoke(IsLive(ref), lambda: pool.is_live(obj), _same)

    def _do_id_bound(self) -> None:
        pool = self.shared.pool
        self._invoke(IdBound(), pool.id_bound, _same)

    # -- the shared store ----------------------------------------------------------------------

    def _do_write(self) -> None:
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
        result = self._invoke(
            StoreWrite(name, layer), lambda: store.write(layer, block, 0, tokens), _nothing
        ).result
        if not isinstance(result, Exception) and not through_stale:
            self.written.setdefault(name, {})[layer] = value

    def _do_read(self) -> None:
        store, backend = self.shared.store, self.shared.backend
        assert store is not None and backend is not None, "read is only drawn with a store"
        rng = self.rng
        layer = rng.randrange(store.n_layers)
        held = {name: block for owner in self._private for name, block in self.held[owner]}
        readable = [n for n, layers in self.written.items() if layer in layers and n in held]
        if not readable:
            return
        names = rng.sample(readable, min(len(readable), rng.randint(1, 3)))
        blocks = [held[name] for name in names]
        n_tokens = len(blocks) * self._block_size
        result = self._invoke(
            StoreRead(tuple(names), layer),
            lambda: backend.to_numpy(store.gather(layer, blocks, n_tokens)),
            _nothing,
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
                    f"thread {self.index} read block id {block.block_id} (handle "
                    f"h{name[0]}.{name[1]}, layer {layer}) and found {found}, but it wrote "
                    f"{expected} there and no one else writes to it: two live handles share "
                    "storage, or a write was lost",
                )


def _block_ids(blocks: list[Block]) -> tuple[int, ...]:
    return tuple(block.block_id for block in blocks)


def _nothing(result: object) -> None:
    del result


def _same(result: T) -> T:
    return result
