"""The linearized history, replayed on a real store as it is decided, and saved as a trace.

Once the linearizability checker has decided an order for a stretch of the
history, :class:`LinearizedReplay` appends those calls, in that order and
without their times, to a JSON-lines trace file
(:mod:`veloxquant_mlx.testing.traces`) and applies them, one by one, to an
:class:`~veloxquant_mlx.testing.aliasing.AliasingReplay` on MLX (or NumPy)
storage: a fresh sequential pool, beside the spec, must give every recorded
outcome (the same block ids, errors, counts, stats, names), and after every
call the store's data, liveness and capacity are checked. Every call is in
the trace, queries, store calls and calls with bad arguments included. The
trace file replays again later with one command::

    veloxquant-mlx replay RUN_DIR/linearized.jsonl

The trace is written as ``linearized.partial.jsonl``, its header marked
``"partial": true``, while the run goes on; only when every call of the run
was checked and replayed does :meth:`LinearizedReplay.close` turn it into
``linearized.jsonl`` (atomically, without the mark). A run that was
interrupted or whose checking gave up leaves the partial file, which
replays with the verdict "inconclusive", never "ok". The file written so far
is also the prefix of a violation's reproducer (:mod:`.reproducer`).

Complexity: O(1) per call to write; the replay costs what
:class:`AliasingReplay` costs per call. Thread safety: one thread feeds it.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final, TextIO

from veloxquant_mlx.commandline.files import atomic_file
from veloxquant_mlx.commandline.verdicts import Gap
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.stress.report import PARTIAL_TRACE_NAME, TRACE_NAME
from veloxquant_mlx.testing import traces
from veloxquant_mlx.testing.aliasing import (
    AliasingReplay,
    ReplayError,
    StorageBackend,
    builtin_backend,
)
from veloxquant_mlx.testing.traces import TraceLine

__all__ = ["PARTIAL_TRACE_NAME", "TRACE_NAME", "LinearizedReplay", "backend_named"]


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
        history_len: int = 0,
    ) -> None:
        """Replay on ``backend`` (``None``: only save); write into ``folder`` (``None``: don't)."""
        self.backend_name: Final = "none" if backend is None else backend.name
        self.ops_written = 0
        self.ops_replayed = 0
        self.ops_not_replayed = 0
        self.failure: ReplayError | None = None
        self.stopped_because: str | None = None
        self._folder = folder
        self._header = traces.Trace(pool, store, history_len=history_len)
        self._engine = (
            None
            if backend is None
            else AliasingReplay(pool, store, backend, history_len=history_len)
        )
        self._file: TextIO | None = None
        self.path: Path | None = None
        if folder is not None:
            self.path = folder / PARTIAL_TRACE_NAME
            self._file = self.path.open("w", encoding="utf-8")
            partial = replace(self._header, partial=True)
            self._file.write(traces.encode_header(partial) + "\n")
            self._file.flush()

    def feed(self, events: Sequence[TraceLine]) -> None:
        """Save and replay ``events``, in this (linearization) order; stop at a failure."""
        for event in events:
            if self.failure is not None:
                continue
            if self.stopped_because is not None:
                self.ops_not_replayed += 1
                continue
            line = event.untimed()  # replayed in this order: no times
            if self._file is not None:
                self._file.write(traces.encode_line(line) + "\n")
                self.ops_written += 1
            if self._engine is not None:
                try:
                    self._engine.apply(line)
                except ReplayError as failure:
                    self.failure = failure
                    continue
                self.ops_replayed += 1
        if self._file is not None:
            self._file.flush()  # a reproducer copies what is written so far

    @property
    def complete(self) -> bool:
        """Whether the file holds every call fed so far (nothing stopped or failed)."""
        return self.failure is None and self.stopped_because is None

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

    def finish(self) -> None:
        """After the last call: the reads still held are checked (a failure is kept, as
        :meth:`feed` keeps one); nothing if replaying stopped or failed before."""
        if self._engine is None or self.failure is not None or self.stopped_because is not None:
            return
        try:
            self._engine.finish()
        except ReplayError as failure:
            self.failure = failure

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
            whole.write(traces.encode_header(self._header, n_lines=self.ops_written) + "\n")
            shutil.copyfileobj(partial, whole)
        with contextlib.suppress(OSError):
            self.path.unlink()
        self.path = final
