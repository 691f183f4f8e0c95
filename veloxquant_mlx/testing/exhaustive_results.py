"""What the exhaustive checker reports: a counterexample, and the outcome of one scope.

Used by :mod:`~veloxquant_mlx.testing.exhaustive`, its command line and the
conformance report. Complexity: O(calls) to print or encode. Thread safety:
immutable values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from veloxquant_mlx.commandline.verdicts import Gap, Verdict, verdict_of
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.testing.exhaustive_scope import Scope
from veloxquant_mlx.testing.lockstep import ConformanceError
from veloxquant_mlx.testing.traces import Trace, TraceLine, encode_line
from veloxquant_mlx_spec import model

__all__ = ["Counterexample", "Exploration"]


@dataclass(frozen=True)
class Counterexample:
    """A sequence on which the allocator and the spec disagree (a shortest one)."""

    letters: tuple[str, ...]
    operations: tuple[object, ...]  # replays with a fresh Lockstep, labelled 0, 1, 2...
    message: str  # the ConformanceError's
    scope: Scope | None = None  # where it was found
    #: The lockstep failure itself (what differed, and the calls), when there was one.
    error: ConformanceError | None = field(default=None, compare=False, repr=False)

    @property
    def trace(self) -> Trace:
        """The sequence as a trace (calls labelled 0, 1, 2...), for ``veloxquant-mlx replay``."""
        config = self.scope.config if self.scope is not None else model.SpecConfig()
        pool = PoolConfig(
            config.block_size,
            config.n_blocks,
            config.separate_kv,
            config.grow_on_exhaustion,
            config.max_blocks,
        )
        history_len = 0 if self.scope is None else self.scope.history_len
        lines = tuple(TraceLine(op, call) for call, op in enumerate(self.operations))
        return Trace(pool, lines=lines, history_len=history_len)

    def __str__(self) -> str:
        steps = [
            f"\n  {i}: {op!r}" + ("" if letter == repr(op) else f"  # {letter}")
            for i, (letter, op) in enumerate(zip(self.letters, self.operations, strict=True))
        ]
        return f"{len(self.operations)} operations:{''.join(steps)}\n{self.message}"

    def to_json(self) -> dict[str, object]:
        """JSON-ready values; the calls as trace lines (docs/TRACE_FORMAT.md)."""
        lines = [json.loads(encode_line(line)) for line in self.trace.lines]
        return {"letters": list(self.letters), "lines": lines, "message": self.message}


@dataclass(frozen=True)
class Exploration:
    """The outcome of exploring one scope to one depth."""

    scope: str
    depth: int
    states: int  # distinct canonical states within the depth, the initial one included
    transitions: int  # (state, letter) pairs checked in lockstep
    merges_probed: int  # transitions into an already seen state, checked with probe()
    new_states_per_depth: tuple[int, ...]
    seconds: float
    counterexample: Counterexample | None
    gap: Gap | None = None  # what a budget cut off, if one ran out
    no_op_runs_probed: int = 0  # states whose no-op letters were run together, then probed

    @property
    def verdict(self) -> Verdict:
        """Violation (a counterexample), inconclusive (a budget ran out) or OK."""
        gaps = () if self.gap is None else (self.gap,)
        return verdict_of(violations=self.counterexample is not None, gaps=gaps)

    def summary(self) -> str:
        """One line: scope, depth, states, transitions, time and verdict."""
        verdict = "COUNTEREXAMPLE" if self.counterexample is not None else self.verdict.label
        cut = "" if self.gap is None or self.counterexample is not None else f" ({self.gap})"
        return (
            f"{self.scope}: depth {self.depth}, {self.states} distinct states, "
            f"{self.transitions} transitions, {self.merges_probed} merges probed, "
            f"{self.no_op_runs_probed} no-op runs probed, "
            f"{self.seconds:.1f}s, {verdict}{cut}"
        )

    def to_json(self) -> dict[str, object]:
        """JSON-ready values."""
        found = self.counterexample
        return {
            "scope": self.scope,
            "depth": self.depth,
            "states": self.states,
            "transitions": self.transitions,
            "merges_probed": self.merges_probed,
            "no_op_runs_probed": self.no_op_runs_probed,
            "new_states_per_depth": list(self.new_states_per_depth),
            "seconds": round(self.seconds, 3),
            "verdict": self.verdict.value,
            "not_checked": None if self.gap is None else self.gap.to_json(),
            "counterexample": None if found is None else found.to_json(),
        }
