"""Reproducers of linearizability violations, and the one replay of any trace.

When a window of a stress run has no valid order, the runner writes a
reproducer (:func:`write_reproducer`): a trace (docs/TRACE_FORMAT.md) of the
run's linearized calls so far (the state the window started in) followed by
the minimal failing window as timed lines. It needs nothing from the run::

    veloxquant-mlx replay RUN_DIR/violation-linearizability.jsonl --on spec

:func:`replay_trace` is that command's engine, for every trace: untimed
lines apply in order, each checked against what it records; a maximal run
of timed lines is a concurrent window, linearized on the spec from every
state the lines before may end in (no valid order: a violation, explained;
the search budget run out: inconclusive). Its orders may end in several
states, and only some may allow the lines after it, so all are carried on
(:class:`_Orders`), and the target is given the lines in an order that the
whole trace allows. ``on`` says where: ``spec`` (the executable spec
alone), ``pool`` (the allocator beside the spec, its outcomes compared call
by call and everything observable after the last line; or a port given
instead, whose every observation is compared after every call; store calls
are skipped) or a store backend (``numpy``, ``mlx``, ``mlx-lazy``: the
aliasing replay, which also checks the store's data). A partial trace that
replays clean is inconclusive, never OK.

Complexity: O(lines) spec transitions (stale handles compacted away), plus
one search per window; on a store, what the aliasing replay costs. Thread
safety: pure functions plus file I/O.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from veloxquant_mlx.commandline.files import atomic_file
from veloxquant_mlx.commandline.progress import ProgressThrottle
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.stress.checker import Violation
from veloxquant_mlx.stress.linearizability import DEFAULT_BUDGET, Witness, search
from veloxquant_mlx.stress.minimal import explain
from veloxquant_mlx.stress.report import REPRODUCER_NAME
from veloxquant_mlx.stress.specstep import (
    Checkpoint,
    compact,
    initial_checkpoint,
    predicted_outcome,
    step,
)
from veloxquant_mlx.testing.aliasing import (
    AliasingReplay,
    ReplayError,
    builtin_backend,
    mlx_backend,
    spec_config,
)
from veloxquant_mlx.testing.exhaustive_scope import default_factory
from veloxquant_mlx.testing.lockstep import Check, ConformanceError, Lockstep
from veloxquant_mlx.testing.port import Port
from veloxquant_mlx.testing.replay_command import TARGETS
from veloxquant_mlx.testing.sides import describe
from veloxquant_mlx.testing.traces import Trace, TraceLine, encode_header, encode_line
from veloxquant_mlx_spec.table import declaration_of

__all__ = ["REPRODUCER_NAME", "replay_trace", "write_reproducer"]

_COMPACT_AFTER: Final = 256


def write_reproducer(path: Path, violation: Violation, header: Trace, prefix: Path | None) -> None:
    """Write ``violation`` as a trace: ``prefix``'s lines (the calls before the window), then
    the minimal window, timed. ``header`` gives the pool, store and history length; with no
    ``prefix`` (the linearized calls were not all saved), mark it partial."""
    if prefix is None:
        header = replace(header, partial=True)
    n_lines = len(violation.window) + (0 if prefix is None else _lines_after_header(prefix))
    with atomic_file(path) as out:
        out.write(encode_header(header, n_lines=n_lines) + "\n")
        if prefix is not None:
            with prefix.open(encoding="utf-8") as lines:
                lines.readline()  # its own header
                shutil.copyfileobj(lines, out)
        for event in violation.window:
            out.write(encode_line(event) + "\n")


def _lines_after_header(path: Path) -> int:
    """The call lines of the trace file at ``path`` (its writer writes no blank line)."""
    with path.open(encoding="utf-8") as lines:
        return sum(1 for _ in lines) - 1


def _segments(lines: Sequence[TraceLine]) -> Iterator[tuple[bool, list[TraceLine]]]:
    """``(timed, lines)`` runs: untimed lines one by one, timed ones as whole windows."""
    window: list[TraceLine] = []
    for line in lines:
        if line.timed:
            window.append(line)
            continue
        if window:
            yield True, window
            window = []
        yield False, [line]
    if window:
        yield True, window


@dataclass
class _Target:
    """Where lines are applied besides the spec: a pool, or a pool and a store."""

    engine: AliasingReplay[Any] | Lockstep | None
    skipped: int = 0  # store calls a pool-only replay leaves out

    def apply(self, line: TraceLine) -> None:
        engine = self.engine
        if isinstance(engine, AliasingReplay):
            engine.apply(line)
        elif engine is not None:
            if declaration_of(line.op).target == "store":
                self.skipped += 1
                return
            engine.apply(line.op, line.call, expect=line.outcome)

    def compare_at_the_end(self) -> None:
        """After the last line: a store's reads still held are checked, and everything
        observable on a pool compared only call by call (``Check.OUTCOMES``, for long
        histories), where a deviation that no outcome showed, such as an exhaustive
        counterexample's query after its last call, is.

        Raises:
            ReplayError: A held read changed.
            ConformanceError: The pool and the spec differ.
        """
        engine = self.engine
        if isinstance(engine, AliasingReplay):
            engine.finish()
        elif isinstance(engine, Lockstep) and engine.check is Check.OUTCOMES:
            engine.compare_observations()

    def compare_fresh_pool(self) -> None:
        """A port's fresh pool against the spec's, before any line: a counterexample found
        there (``exhaustive`` compares it first) has no call to replay.

        Raises:
            ConformanceError: They differ.
        """
        engine = self.engine
        if isinstance(engine, Lockstep) and engine.check is not Check.OUTCOMES:
            engine.compare_observations()


def _target(trace: Trace, on: str, port: Port | None) -> _Target:
    if on == "spec":
        return _Target(None)
    config = spec_config(trace.pool)
    if port is not None:  # a port's finding may be a value read after a call: read them all
        return _Target(Lockstep(port, config, trace.history_len, check=Check.STATE))
    if on == "pool":
        return _Target(Lockstep(default_factory, config, trace.history_len, check=Check.OUTCOMES))
    backend = mlx_backend(lazy_writes=True) if on == "mlx-lazy" else builtin_backend(on)
    return _Target(AliasingReplay(trace.pool, trace.store, backend, history_len=trace.history_len))


def replay_trace(
    trace: Trace,
    on: str = "spec",
    *,
    budget: int | None = DEFAULT_BUDGET,
    port: Port | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Verdict, str]:
    """Replay ``trace`` on the spec and ``on`` (module docstring): its verdict, and why.

    Args:
        trace: What to replay.
        on: Where, besides the spec (:data:`TARGETS`).
        budget: Configurations one window's linearization may expand.
        port: With ``on="pool"``, the pool to replay on instead of ours.
        progress: Told ``"N of M lines, S s"`` at most once per
            :data:`~veloxquant_mlx.commandline.progress.PROGRESS_INTERVAL_S` seconds.

    Raises:
        ValueError: ``on`` is not one of :data:`TARGETS`, or a port with another ``on``.
    """
    if on not in TARGETS:
        raise ValueError(f"a replay target must be one of {TARGETS}, got {on!r}")
    if port is not None and on != "pool":
        raise ValueError(f"a port is replayed on with on='pool', got {on!r}")
    target = _target(trace, on, port)
    if port is not None:
        on = f"port {port.name}"
    orders = _Orders(trace, target, progress)
    try:
        target.compare_fresh_pool()
    except ConformanceError as failure:
        return Verdict.VIOLATION, f"replay on {on} FAILED: a fresh pool, before line 1: {failure}"
    try:
        for timed, segment in _segments(trace.lines):
            refused = orders.window(segment, budget) if timed else orders.line(segment[0])
            if refused is not None:
                verdict, why = refused
                return (
                    verdict,
                    f"replay on {on} FAILED: {why}" if verdict is Verdict.VIOLATION else why,
                )
        orders.apply_pending()
        target.compare_at_the_end()
    except (ReplayError, ConformanceError) as failure:
        return Verdict.VIOLATION, f"replay on {on} FAILED: line {orders.where}: {failure}"
    skipped = f" ({target.skipped} store calls left out)" if target.skipped else ""
    done = f"{len(trace.lines)} ops replayed on {on}{skipped}"
    if trace.partial:
        return Verdict.INCONCLUSIVE, (
            f"{done}, no failure, but INCONCLUSIVE: the trace is marked partial (its run was "
            "interrupted or its checking gave up), so the rest of that history was never checked"
        )
    return Verdict.OK, f"{done}: ok"


@dataclass(frozen=True)
class _Segment:
    """Lines replayed on the spec but not yet on the target: ``lines`` from position
    ``start`` of the trace, and, for each state the spec may now be in, how it got there
    (``witnesses[i]``: from which earlier state, in which order of ``lines``)."""

    start: int
    lines: list[TraceLine]
    witnesses: list[Witness]


class _Orders:
    """Every spec state the lines so far may end in, and the target kept one order behind.

    A window's calls may be linearized in several orders that end in different
    states, and a later line may allow only some of them; so every end state is
    carried on (as the stress checker carries them), each with how it was
    reached. The target, a real pool or store that cannot go back, is given the
    lines once a single state is left, in the order that leads to it.

    Invariants: ``frontier`` is not empty; ``pending[k].witnesses`` has one
    entry per state the spec could be in after ``pending[k]``, the last
    segment's aligned with ``frontier``. The states are compacted (stale
    handles dropped) every :data:`_COMPACT_AFTER` lines, so a state holds the
    live handles and at most that many lines' stale ones.
    """

    def __init__(
        self, trace: Trace, target: _Target, progress: Callable[[str], None] | None
    ) -> None:
        self.trace: Final = trace
        self.target: Final = target
        self.layers: Final = trace.store.n_layers
        self.frontier = [initial_checkpoint(spec_config(trace.pool), trace.history_len)]
        self.pending: list[_Segment] = []
        self.next_line = 0  # the trace position of the next segment's first line
        self.since_compaction = 0  # lines stepped since the frontier was last compacted
        self.where = 0  # the file line of the line last given to the target
        self.replayed = 0
        self.progress: Final = progress
        self.throttle: Final = ProgressThrottle()

    def line(self, line: TraceLine) -> tuple[Verdict, str] | None:
        """Step an untimed line from every state; the refusal if no state allows it."""
        ends: dict[Checkpoint, Witness] = {}  # distinct states (one state is not hashed)
        for index, checkpoint in enumerate(self.frontier):
            after = step(checkpoint.state, checkpoint.names, line, (), store_layers=self.layers)
            if after is None:
                continue
            if len(self.frontier) == 1:
                self._advance([line], [Checkpoint(*after)], [Witness(0, (0,))])
                return None
            ends.setdefault(Checkpoint(*after), Witness(index, (0,)))
        if not ends:
            where = self.trace.file_line(self.next_line)
            why = _contradiction(where, line, self.frontier[0], self.layers)
            if len(self.frontier) > 1:
                why += f" (nor in any of the {len(self.frontier)} states the window before allows)"
            return Verdict.VIOLATION, why
        self._advance([line], list(ends), list(ends.values()))
        return None

    def window(self, lines: list[TraceLine], budget: int | None) -> tuple[Verdict, str] | None:
        """Linearize a window from every state; the verdict if it has no valid order."""
        result = search(self.frontier, lines, store_layers=self.layers, budget=budget)
        if not result.complete:
            return Verdict.INCONCLUSIVE, (
                f"not decided: the search budget of {budget:,} configurations ran out on a "
                f"window of {len(lines)} calls"
            )
        if not result.ends:
            why = explain(self.frontier, lines, store_layers=self.layers, budget=budget)
            return Verdict.VIOLATION, f"a window is not linearizable: {why}"
        self._advance(lines, list(result.ends), list(result.ends.values()))
        return None

    def _advance(
        self, lines: list[TraceLine], ends: list[Checkpoint], witnesses: list[Witness]
    ) -> None:
        """Go on from ``ends`` (``witnesses[i]`` says how ``ends[i]`` was reached)."""
        self.pending.append(_Segment(self.next_line, lines, witnesses))
        self.frontier = ends
        self.next_line += len(lines)
        self.since_compaction += len(lines)
        if self.since_compaction >= _COMPACT_AFTER:
            self.frontier = [compact(end.state, end.names) for end in ends]
            self.since_compaction = 0
        if len(self.frontier) == 1:
            self.apply_pending()

    def apply_pending(self) -> None:
        """Give the target the pending lines in the order that reaches ``frontier[0]``.

        Raises:
            ReplayError, ConformanceError: The target refuses a line or disagrees.
        """
        orders: list[tuple[int, ...]] = []
        state = 0
        for segment in reversed(self.pending):
            witness = segment.witnesses[state]
            orders.append(witness.order)
            state = witness.start
        for segment, order in zip(self.pending, reversed(orders), strict=True):
            for index in order:
                self.where = self.trace.file_line(segment.start + index)
                self.target.apply(segment.lines[index].untimed())
                self._count_one()
        self.pending.clear()
        self.frontier = self.frontier[:1]

    def _count_one(self) -> None:
        self.replayed += 1
        if self.progress is not None and self.throttle.due():
            total = len(self.trace.lines)
            self.progress(f"{self.replayed:,} of {total:,} lines, {self.throttle.seconds():.0f} s")


def _contradiction(file_line: int, line: TraceLine, at: Checkpoint, layers: int) -> str:
    """Why the spec refuses a recorded line (line ``file_line`` of its file) of a history
    whose store has ``layers`` layers."""
    recorded = "(nothing)" if line.outcome is None else describe(line.outcome)
    predicted = predicted_outcome(at.state, at.names, line, (), store_layers=layers)
    return f"line {file_line} {encode_line(line)}: it records {recorded}; the spec: {predicted}"
