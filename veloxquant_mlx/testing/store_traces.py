"""Traces for the aliasing replay: a few canned ones, and random ones drawn by Hypothesis.

:data:`CANNED_TRACES` are short traces through every kind of call, each
aimed at one way a store can go wrong (growth and shrink, stale handles,
lazy reads across resizes). :func:`drive_random_trace` draws a pool, a
store shape and calls one at a time, applying each to an
:class:`~veloxquant_mlx.testing.aliasing.AliasingReplay` as it is drawn:
pool calls of the operation table (arguments from their domains,
:mod:`veloxquant_mlx.testing.strategies`, with a bad one now and then) and
store calls (``write``, ``gather``, ``sync``) aimed at the live handles, a
stale one now and then. A failing trace is attached to the Hypothesis report
and, when ``VELOXQUANT_TRACE_DIR`` names a folder, saved there
(:func:`save_failing_trace`), so ``veloxquant-mlx replay`` reproduces it.

Requires the ``dev`` extra (Hypothesis). Complexity: O(calls x live blocks)
per trace. Thread safety: each trace builds its own pool and store.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, TypeVar

from hypothesis import given, note, settings
from hypothesis import strategies as st

from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.testing.aliasing import (
    AliasingReplay,
    ReplayError,
    StorageBackend,
    spec_config,
)
from veloxquant_mlx.testing.store_operations import Gather, Sync, Write
from veloxquant_mlx.testing.strategies import bad_call, call
from veloxquant_mlx.testing.traces import StoreSpec, Trace, TraceLine, dumps, save
from veloxquant_mlx_spec.operations import (
    Allocate,
    Free,
    FreeAll,
    MarkUsed,
    RegisterOwner,
    ReleaseOwner,
    Shrink,
)
from veloxquant_mlx_spec.table import (
    ArgKind,
    Handle,
    Raised,
    Returned,
    declaration_named,
    declarations,
    h,
)

__all__ = [
    "CANNED_TRACES",
    "TRACE_DIR_VARIABLE",
    "drive_random_trace",
    "random_trace_test",
    "save_failing_trace",
]

ArrayT = TypeVar("ArrayT")
T = TypeVar("T")

TRACE_DIR_VARIABLE: Final = "VELOXQUANT_TRACE_DIR"

_GROWING = PoolConfig(block_size=2, n_blocks=2, separate_kv=True, grow_on_exhaustion=True)
_SMALL = StoreSpec(n_layers=2, n_kv_heads=1, head_dim=2)
_VALUE_ERROR = Raised("ValueError")

#: Short traces through every kind of call, each aimed at one way a store can go wrong.
CANNED_TRACES: dict[str, Trace] = {
    "grow-shrink-regrow": Trace(
        _GROWING,
        _SMALL,
        (
            TraceLine(Allocate("k", 2, 1), 0),
            TraceLine(Allocate("v", 10, 2), 1),  # grows the "v" stream: ids 1..5
            TraceLine(Write(1, h(1, 4), 1, 1)),
            TraceLine(FreeAll(2)),
            TraceLine(Shrink("v", 0), outcome=Returned(5)),  # id_bound 6 -> 1: memory back
            TraceLine(Sync()),
            TraceLine(Allocate("v", 12, 3), 2),  # regrows on the retired ids
            TraceLine(Gather(0, (h(0, 0), h(2, 5)), 4)),
        ),
    ),
    "stale-handles": Trace(
        _GROWING,
        _SMALL,
        (
            TraceLine(Allocate("k", 2, 1), 0),
            TraceLine(Free((h(0, 0),))),
            TraceLine(Allocate("k", 2, 2), 1),  # same id, new handle
            TraceLine(Write(0, h(0, 0), 0, 1), outcome=_VALUE_ERROR),
            TraceLine(Free((h(0, 0),)), outcome=Raised("InvalidFreeError")),
            TraceLine(MarkUsed(h(0, 0), 1)),
            TraceLine(MarkUsed(h(1, 0), 1)),
            TraceLine(RegisterOwner(5)),
            TraceLine(RegisterOwner(5), outcome=Raised("OwnerAlreadyActiveError")),
            TraceLine(ReleaseOwner(5)),
            TraceLine(Gather(1, (h(1, 0),), 3), outcome=_VALUE_ERROR),
            TraceLine(Write(1, h(1, 0), 1, 2), outcome=_VALUE_ERROR),
        ),
    ),
    "lazy-reads-across-resizes": Trace(
        _GROWING,
        _SMALL,
        (
            TraceLine(Allocate("k", 2, 1), 0),
            TraceLine(Gather(0, (h(0, 0),), 2, hold=6)),
            TraceLine(Gather(1, (h(0, 0),), 1, hold=3)),
            TraceLine(Write(0, h(0, 0), 0, 2)),
            TraceLine(Allocate("k", 16, 2), 1),  # growth
            TraceLine(Write(1, h(0, 0), 1, 1)),
            TraceLine(FreeAll(2)),
            TraceLine(Shrink("k", 0)),  # shrink
            TraceLine(Write(0, h(0, 0), 1, 1)),
        ),
    ),
}

#: How often each kind of call is drawn (the rest of the pool's calls that change it: 1).
_WEIGHTS: Final = {"allocate": 3, "free": 2, "write": 3, "gather": 2}


@st.composite
def pool_configs(draw: st.DrawFn) -> PoolConfig:
    """Small pools of every kind: both stream modes, growth on and off, capped or not."""
    n_blocks = draw(st.integers(0, 8))
    grow = draw(st.booleans())
    cap = draw(st.none() | st.integers(n_blocks, n_blocks + 8)) if grow else None
    return PoolConfig(
        block_size=draw(st.integers(1, 4)),
        n_blocks=n_blocks,
        separate_kv=draw(st.booleans()),
        grow_on_exhaustion=grow,
        max_blocks=cap,
    )


def store_specs() -> st.SearchStrategy[StoreSpec]:
    """Small store shapes, in float32 (exact sentinels) or float16 (a real KV dtype)."""
    return st.builds(
        StoreSpec,
        n_layers=st.integers(1, 2),
        n_kv_heads=st.integers(1, 2),
        head_dim=st.integers(1, 2),
        dtype=st.sampled_from(["float32", "float16"]),
    )


def _kinds() -> list[str]:
    kinds = [d.name for d in declarations() if d.changes_state] + ["write", "gather", "sync"]
    return [kind for kind in kinds for _ in range(_WEIGHTS.get(kind, 1))]


def _pick(data: st.DataObject, items: Sequence[T]) -> T:
    """One of ``items`` (drawn as an index: cheaper than a new ``sampled_from`` per draw)."""
    return items[data.draw(st.integers(0, len(items) - 1))]


def _odd(data: st.DataObject) -> bool:
    """True one time in five: use a bad argument this time."""
    return data.draw(st.integers(0, 4)) == 0


def _draw_line(data: st.DataObject, engine: AliasingReplay[ArrayT]) -> TraceLine:
    """One call for the engine's current state; handles come from those it has handed out.

    Arguments are valid most of the time (so that blocks get allocated, written,
    grown and retired) and wrong otherwise (stale handles, bad slots, layers,
    arguments), so that refusals are exercised too.
    """
    known, live = engine.known_refs(), engine.live_refs()
    kind = _pick(data, _KINDS)
    if kind in ("write", "gather") and not known:
        kind = "allocate"
    handles = live if live and not _odd(data) else known  # a stale handle now and then
    if kind == "write":
        return TraceLine(_draw_write(data, engine, _pick(data, handles)))
    if kind == "gather":
        refs = tuple(_pick(data, handles) for _ in range(data.draw(st.integers(1, 3))))
        return TraceLine(_draw_gather(data, engine, refs))
    if kind == "sync":
        return TraceLine(Sync())
    declaration = declaration_named(kind)
    assert declaration is not None, kind
    config = spec_config(engine.pool.config)
    names = {"live": live, "issued": known}
    has_values = any(p.kind is ArgKind.VALUE for p in declaration.parameters)
    if has_values and data.draw(st.integers(0, 9)) == 0:  # one bad argument, one time in ten
        op = data.draw(bad_call([declaration], config, **names))
    else:
        op = data.draw(call(declaration, config, **names))
    return TraceLine(op, engine.next_call())


_KINDS: Final = _kinds()


def _draw_write(data: st.DataObject, engine: AliasingReplay[ArrayT], ref: Handle) -> Write:
    block_size, n_layers = engine.pool.config.block_size, engine.spec.n_layers
    bad = _pick(data, ("layer", "start", "n_tokens")) if _odd(data) else ""
    layer = n_layers if bad == "layer" else data.draw(st.integers(0, n_layers - 1))
    start = _pick(data, (-1, block_size)) if bad == "start" else _pick(data, range(block_size))
    room = block_size - max(start, 0)
    n_tokens = room + 1 if bad == "n_tokens" else data.draw(st.integers(min(room, 1), room))
    return Write(layer, ref, start, n_tokens)


def _draw_gather(
    data: st.DataObject, engine: AliasingReplay[ArrayT], refs: tuple[Handle, ...]
) -> Gather:
    block_size, n_layers = engine.pool.config.block_size, engine.spec.n_layers
    bad = _pick(data, ("layer", "n_tokens")) if _odd(data) else ""
    layer = n_layers if bad == "layer" else data.draw(st.integers(0, n_layers - 1))
    available = len(refs) * block_size
    n_tokens = available + 1 if bad == "n_tokens" else data.draw(st.integers(0, available))
    return Gather(layer, refs, n_tokens, hold=data.draw(st.integers(0, 3)))


def drive_random_trace(
    backend: StorageBackend[ArrayT], data: st.DataObject, max_ops: int = 30
) -> Trace:
    """Draw a pool, a store shape and up to ``max_ops`` calls; apply each as it is drawn.

    On a failure the trace so far is attached to the Hypothesis report (and
    saved under ``$VELOXQUANT_TRACE_DIR`` if set) before the error propagates.

    Returns:
        The trace applied, with outcomes.

    Raises:
        ReplayError: The first call after which a check failed.
    """
    engine = AliasingReplay(data.draw(pool_configs()), data.draw(store_specs()), backend)
    try:
        for _ in range(data.draw(st.integers(1, max_ops))):
            engine.apply(_draw_line(data, engine))
        engine.finish()
    except ReplayError:
        path = save_failing_trace(engine.trace(), backend.name)
        note(f"failing trace ({backend.name}); replay it with veloxquant-mlx replay:")
        note(dumps(engine.trace()) + ("" if path is None else f"saved to {path}"))
        raise
    return engine.trace()


def save_failing_trace(trace: Trace, source: str) -> Path | None:
    """Save a failing trace under ``$VELOXQUANT_TRACE_DIR`` (if set); the path, or None."""
    directory = os.environ.get(TRACE_DIR_VARIABLE)
    if not directory:
        return None
    digest = hashlib.sha256(dumps(trace).encode()).hexdigest()[:12]
    path = Path(directory) / f"failing-{source}-{digest}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    save(trace, path)
    return path


def random_trace_test(
    backend: StorageBackend[ArrayT], *, max_examples: int = 40, max_ops: int = 30
) -> Callable[[], None]:
    """A Hypothesis test (assign it to a ``test_...`` name) replaying random traces on ``backend``.

    ``max_examples`` overrides the active profile's count, keeping this test
    fast by default; raise it for a nightly run.
    """

    @settings(max_examples=max_examples, deadline=None)
    @given(data=st.data())
    def test_random_traces_replay_cleanly(data: st.DataObject) -> None:
        drive_random_trace(backend, data, max_ops)

    return test_random_traces_replay_cleanly
