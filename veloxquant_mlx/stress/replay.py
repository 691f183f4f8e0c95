"""The linearized history, replayed through the aliasing replay on a real store, and saved.

Once the linearizability checker has decided an order for a stretch of the
history, :class:`LinearizedReplay` turns those calls into the ops of
:mod:`veloxquant_mlx.testing.traces`, appends them to a JSON-lines trace file
and applies them, one by one, to an :class:`~veloxquant_mlx.testing.aliasing.AliasingReplay`
on MLX (or NumPy) storage: a fresh sequential pool must give every recorded
outcome (the same block ids, the same errors, the same shrink counts), and
after every ``free``, growing ``allocate`` and ``shrink`` the store's data,
liveness and capacity are checked. The trace file replays again later with
one command::

    python -m stress --replay RUN_DIR/linearized.jsonl
    python -m veloxquant_mlx.testing.aliasing RUN_DIR/linearized.jsonl

Calls the trace format cannot express are left out, and leaving them out
changes nothing a sequential replay can see: read-only queries and store
calls (they change no pool state), and calls whose arguments are not of the
trace's types or name a foreign block or a non-block (the spec makes every
one of them fail without changing state; the checker already verified that
they did).

The trace is written as ``linearized.partial.jsonl``, its header marked
``"partial": true``, while the run goes on; only when every call of the run
was checked and replayed does :meth:`LinearizedReplay.close` turn it into
``linearized.jsonl`` (atomically, without the mark). A run that was
interrupted or whose checking gave up leaves the partial file, which
replays with the verdict "inconclusive", never "ok".

Complexity: O(1) per call to convert; the replay costs what
:class:`AliasingReplay` costs per op. Thread safety: one thread feeds it.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from veloxquant_mlx.commandline.files import atomic_file
from veloxquant_mlx.commandline.verdicts import Gap
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.stress.history import (
    Allocate,
    Event,
    Free,
    FreeAll,
    MarkUsed,
    Raised,
    RegisterOwner,
    ReleaseOwner,
    Returned,
    Shrink,
)
from veloxquant_mlx.testing import traces
from veloxquant_mlx.testing.aliasing import (
    AliasingReplay,
    ReplayError,
    StorageBackend,
    builtin_backend,
)
from veloxquant_mlx_spec.model import NotAList

__all__ = [
    "PARTIAL_TRACE_NAME",
    "TRACE_NAME",
    "LinearizedReplay",
    "backend_named",
    "to_trace_op",
]

#: The linearized trace of a run whose every call was checked and replayed.
TRACE_NAME: Final = "linearized.jsonl"
#: The trace while it is written, and what an interrupted or inconclusive run leaves.
PARTIAL_TRACE_NAME: Final = "linearized.partial.jsonl"


def backend_named(name: str) -> StorageBackend[Any] | None:
    """The aliasing replay's backend ``"mlx"`` or ``"numpy"``; ``None`` for ``"none"``.

    Raises:
        ValueError: Any other name.
    """
    if name == "none":
        return None
    if name not in ("mlx", "numpy"):
        raise ValueError(f"storage backend must be 'mlx', 'numpy' or 'none', got {name!r}")
    return builtin_backend(name)


def _int(value: object) -> int | None:
    """``value`` if it is an ``int`` (not a ``bool``), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _expect(event: Event) -> str | None:
    if isinstance(event.outcome, Raised):
        return event.outcome.kind
    return None if event.outcome is None else "ok"


def to_trace_op(event: Event) -> traces.Op | None:
    """The trace op of a recorded call, or ``None`` if the trace leaves it out (module doc)."""
    call, expect = event.call, _expect(event)
    value = event.outcome.value if isinstance(event.outcome, Returned) else None
    if isinstance(call, Allocate):
        n_tokens, owner = _int(call.n_tokens), _int(call.owner)
        if n_tokens is None or owner is None:
            return None
        if not (isinstance(call.stream, str) and isinstance(call.format, str)):
            return None
        block_ids = value if isinstance(value, tuple) else None
        return traces.Allocate(
            event.op_id, call.stream, n_tokens, owner, call.format, block_ids, expect
        )
    if isinstance(call, Free):
        if isinstance(call.handles, NotAList):
            return None
        names = [ref for ref in call.handles if isinstance(ref, tuple)]
        return traces.Free(tuple(names), expect) if len(names) == len(call.handles) else None
    if isinstance(call, MarkUsed):
        n_used = _int(call.n_used)
        if not isinstance(call.handle, tuple) or n_used is None:
            return None
        return traces.MarkUsed(call.handle, n_used, expect)
    if isinstance(call, Shrink):
        target_free = _int(call.target_free)
        if not isinstance(call.stream, str) or target_free is None:
            return None
        return traces.Shrink(call.stream, target_free, _int(value), expect)
    return _owner_op(call, expect)


def _owner_op(call: object, expect: str | None) -> traces.Op | None:
    if not isinstance(call, (FreeAll, RegisterOwner, ReleaseOwner)):
        return None
    owner = _int(call.owner)
    if owner is None:
        return None
    if isinstance(call, FreeAll):
        return traces.FreeAll(owner, expect)
    if isinstance(call, RegisterOwner):
        return traces.RegisterOwner(owner, expect)
    return traces.ReleaseOwner(owner, expect)


class LinearizedReplay:
    """Saves the linearized calls as a trace and replays them on a store as they come.

    Invariant: the file (if any) holds the header and exactly the ops applied
    so far (plus the failing op, if the replay failed); after a failure
    nothing more is applied; after :meth:`stop` nothing more is applied or
    written, and ``ops_not_replayed`` counts what came after.
    """

    def __init__(
        self,
        pool: PoolConfig,
        store: traces.StoreSpec,
        backend: StorageBackend[Any] | None,
        folder: Path | None,
    ) -> None:
        """Replay on ``backend`` (``None``: only save); write into ``folder`` (``None``: don't)."""
        self.backend_name: Final = "none" if backend is None else backend.name
        self.ops_written = 0
        self.ops_replayed = 0
        self.ops_not_replayed = 0
        self.failure: ReplayError | None = None
        self.stopped_because: str | None = None
        self._folder = folder
        self._header = traces.Trace(pool, store)
        self._engine = None if backend is None else AliasingReplay(pool, store, backend)
        self._file: TextIO | None = None
        self.path: Path | None = None
        if folder is not None:
            self.path = folder / PARTIAL_TRACE_NAME
            self._file = self.path.open("w", encoding="utf-8")
            partial = traces.Trace(pool, store, partial=True)
            self._file.write(traces.encode_header(partial) + "\n")
            self._file.flush()

    def feed(self, events: Sequence[Event]) -> None:
        """Save and replay ``events``, in this (linearization) order; stop at a failure."""
        for event in events:
            op = to_trace_op(event)
            if op is None or self.failure is not None:
                continue
            if self.stopped_because is not None:
                self.ops_not_replayed += 1
                continue
            if self._file is not None:
                self._file.write(traces.encode_op(op) + "\n")
                self.ops_written += 1
            if self._engine is not None:
                try:
                    self._engine.apply(op)
                except ReplayError as failure:
                    self.failure = failure
                    continue
                self.ops_replayed += 1

    def stop(self, reason: str) -> None:
        """Replay and write nothing more (the checking time ran out, or Ctrl-C)."""
        if self.stopped_because is None:
            self.stopped_because = reason

    def gap(self) -> Gap | None:
        """Linearized calls that were not replayed, and why; ``None`` if there were none."""
        if not self.ops_not_replayed or self.failure is not None:
            return None
        done = "saved" if self._engine is None else f"replayed on {self.backend_name} or saved"
        return Gap(
            f"{self.ops_not_replayed:,} linearized calls", f"not {done}: {self.stopped_because}"
        )

    def close(self, *, complete: bool) -> None:
        """Close the trace; if ``complete`` (every call of the run in it), publish it whole.

        A complete trace becomes ``linearized.jsonl`` (written atomically,
        without the partial mark) and the partial file goes; otherwise the
        partial file stays, marked partial.
        """
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if not complete or self.stopped_because is not None or self.path is None:
            return
        assert self._folder is not None, "a trace file lives in a folder"
        final = self._folder / TRACE_NAME
        with self.path.open(encoding="utf-8") as partial, atomic_file(final) as whole:
            partial.readline()  # the header marked partial
            whole.write(traces.encode_header(self._header) + "\n")
            shutil.copyfileobj(partial, whole)
        with contextlib.suppress(OSError):
            self.path.unlink()
        self.path = final
