"""Masking: what an allowed deviation shows, let pass so that a sequence goes on past it.

A conformance report's allow-list marks deliberate deviations (a port that
counts ``n_frees`` its own way, one without ``history``). Without masking,
the :class:`~veloxquant_mlx.testing.lockstep.Lockstep` stops a sequence at
its first difference, allowed or not, so nothing a port does after an
allowed difference is checked; a port whose ``n_frees`` differs after every
``free`` is then never checked past one. With a :class:`Masking` in force
(:data:`MASKING`, set by the report around its sequences), a lockstep leaves
the masked parts of each observation out of its comparison, tells
:attr:`Masking.seen` of each difference it let pass (the report keeps those
of an allowed rule as expected findings), and goes on.

Only observations are masked, never a call's outcome: after a different
outcome the pool and the spec no longer hold the same state. And only what
a whole rule covers: the stats fields its counters count (in ``stats``, in
every ``history`` snapshot and in the Prometheus samples that show them),
all of ``history`` (C-HISTORY), all of ``to_prometheus`` (C-PROMETHEUS),
the sharing counters and their samples (C-COUNTERS-SHARE). A fragmentation
computed from a masked ``n_blocks`` is compared as the spec's fragmented
blocks over the pool's own ``n_blocks``, so that its echo is no difference
while a fault of its own still is. (The peak is not derived so: a port whose
``blocks_in_use`` differs shows its peak under C-COUNTERS-ALLOC as well.)

Complexity: O(size of the observation) per masked observation. Thread safety:
:data:`MASKING` is a context variable, so a masking set in one thread (or
task) is not seen by another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeGuard

from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.operations import History, Prometheus, Stats
from veloxquant_mlx_spec.table import Returned

if TYPE_CHECKING:
    from veloxquant_mlx.testing.lockstep import ConformanceError

__all__ = ["MASKING", "Masking", "in_force"]


@dataclass(frozen=True)
class Masking:
    """The observations a lockstep leaves out of its comparison, and whom it tells.

    Invariant: every name in ``stats_fields`` is one of ``model.STATS_FIELDS``,
    and ``samples`` are Prometheus sample names after the prefix (``frees_total``).

    Attributes:
        stats_fields: Stats fields masked in ``stats`` and in every ``history`` snapshot.
        samples: Prometheus samples masked in ``to_prometheus`` (the same counters).
        queries: Query classes masked whole, whatever they return or raise: ``History``
            (C-HISTORY), ``Prometheus`` (C-PROMETHEUS), the sharing counters
            (C-COUNTERS-SHARE).
        seen: Told the differences let pass after a call, one error each (not raised).
    """

    stats_fields: frozenset[str]
    samples: frozenset[str]
    queries: frozenset[type]
    seen: Callable[[Sequence[ConformanceError]], None]

    def compared(self, where: object, actual: object, predicted: object) -> tuple[object, object]:
        """The pool's and the spec's values of the query ``where`` as compared: the masked
        parts left out; and, with ``n_blocks`` masked, the spec's fragmentation over the
        pool's own ``n_blocks``, so that its echo is no difference, while a fragmentation
        fault of its own still is."""
        if "n_blocks" in self.stats_fields:
            predicted = _over_blocks_of(where, actual, predicted)
        return self._shown(where, actual), self._shown(where, predicted)

    def _shown(self, where: object, outcome: object) -> object:
        """What of ``outcome``, the value observed by the query ``where``, is compared."""
        if type(where) in self.queries:
            return None  # whatever it is: a port without history may raise there
        if not isinstance(outcome, Returned):
            return outcome  # a refused query is compared whole
        if isinstance(where, Stats):
            return Returned(self._snapshot(outcome.value))
        if isinstance(where, History) and isinstance(outcome.value, tuple):
            return Returned(tuple(map(self._snapshot, outcome.value)))
        if isinstance(where, Prometheus) and isinstance(outcome.value, tuple):
            return Returned(self._samples(str(where.prefix), outcome.value))
        return outcome

    def _snapshot(self, values: object) -> object:
        if not isinstance(values, tuple):
            return values
        return tuple(
            None if index < len(_FIELDS) and _FIELDS[index] in self.stats_fields else value
            for index, value in enumerate(values)
        )

    def _samples(self, prefix: str, samples: tuple[object, ...]) -> tuple[object, ...]:
        def masked(sample: object) -> bool:
            name = sample[0] if isinstance(sample, tuple) and sample else None
            return isinstance(name, str) and name.removeprefix(f"{prefix}_") in self.samples

        return tuple(sample for sample in samples if not masked(sample))


_FIELDS: Final = model.STATS_FIELDS
_N_BLOCKS, _FRAGMENTATION = _FIELDS.index("n_blocks"), _FIELDS.index("fragmentation")


def _over_blocks_of(where: object, actual: object, predicted: object) -> object:
    """``predicted`` with every fragmentation it shows (a snapshot's, each history
    snapshot's, the Prometheus ratio) recomputed over the ``n_blocks`` ``actual`` shows."""
    if not (isinstance(actual, Returned) and isinstance(predicted, Returned)):
        return predicted
    ours, theirs = actual.value, predicted.value
    if isinstance(where, Stats):
        return Returned(_refragmented(ours, theirs))
    if not (isinstance(ours, tuple) and isinstance(theirs, tuple)):
        return predicted
    if isinstance(where, History) and len(ours) == len(theirs):
        return Returned(tuple(map(_refragmented, ours, theirs)))
    if isinstance(where, Prometheus):
        return Returned(_reratioed(str(where.prefix), ours, theirs))
    return predicted


def _refragmented(ours: object, theirs: object) -> object:
    """The spec's snapshot ``theirs`` with its fragmentation over ``ours``' ``n_blocks``."""
    if not (isinstance(ours, tuple) and isinstance(theirs, tuple)):
        return theirs
    if min(len(ours), len(theirs)) < len(_FIELDS):
        return theirs
    ratio = _ratio(theirs[_FRAGMENTATION], theirs[_N_BLOCKS], ours[_N_BLOCKS])
    if ratio is None:
        return theirs
    return (*theirs[:_FRAGMENTATION], ratio, *theirs[_FRAGMENTATION + 1 :])


def _reratioed(prefix: str, ours: tuple[object, ...], theirs: tuple[object, ...]) -> object:
    """The spec's samples ``theirs`` with the fragmentation ratio over ``ours``' blocks."""
    blocks, ratio = (f"{prefix}_{model.STATS_SAMPLES[f]}" for f in ("n_blocks", "fragmentation"))
    mine = dict(sample for sample in ours if isinstance(sample, tuple) and len(sample) == 2)
    spec = dict(sample for sample in theirs if isinstance(sample, tuple) and len(sample) == 2)
    if blocks not in mine or blocks not in spec or ratio not in spec:
        return theirs
    value = _ratio(spec[ratio], spec[blocks], mine[blocks])
    if value is None:
        return theirs
    return tuple((ratio, value) if sample == (ratio, spec[ratio]) else sample for sample in theirs)


def _ratio(spec_ratio: object, spec_blocks: object, pool_blocks: object) -> float | None:
    """The spec's fragmented blocks (``spec_ratio`` x ``spec_blocks``) over ``pool_blocks``;
    ``None`` unless all three are numbers."""
    if not (_is_number(spec_ratio) and _is_number(spec_blocks) and _is_number(pool_blocks)):
        return None
    fragmented = round(spec_ratio * spec_blocks)
    return fragmented / pool_blocks if pool_blocks else 0.0


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


#: The masking a lockstep built now takes (``None``: none), read once when it is built.
MASKING: Final[ContextVar[Masking | None]] = ContextVar("MASKING", default=None)


@contextmanager
def in_force(masking: Masking | None) -> Iterator[None]:
    """Every lockstep built inside the block takes ``masking`` (``None``: none)."""
    token = MASKING.set(masking)
    try:
        yield
    finally:
        MASKING.reset(token)
