"""How an allocator's observations differ from the spec's, said as a reader checks them.

:class:`Discrepancy` is what differed (where, which field, both values), for
a report; :func:`differences` walks two observations (every handle's fields,
then every query's outcome, as :func:`~veloxquant_mlx.testing.sides.observe`
lists them) and says each difference: ``Stats() returned (...); the spec
predicts it (...) (stats.n_frees is 2; the spec predicts 1)``; a number equal to the
spec's but of another type says both types (``IsLive(block=h(0, 0)) returned 1
(int); the spec predicts it returned True (bool)``). The
:class:`~veloxquant_mlx.testing.lockstep.Lockstep` raises on the first; a
masking (:mod:`~veloxquant_mlx.testing.masking`) reports each it lets pass.

Values are compared with :func:`~veloxquant_mlx_spec.table.same_value`, as the
lockstep compares them. Complexity: O(size of the observations). Thread safety:
pure functions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from veloxquant_mlx.testing.sides import HANDLE_FIELDS, describe, shown
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.table import Outcome, Returned, same_value

__all__ = ["Discrepancy", "differences"]


@dataclass(frozen=True)
class Discrepancy:
    """What differed, for a report: where, and both values.

    ``where`` is the call (``Allocate(...)``) whose outcome differs, or the
    observation (``Stats()``, ``h(0, 1)``) whose value differs after the last
    call; ``field`` narrows it (``n_frees``, ``owner``); ``kind`` is
    ``"outcome"``, ``"observation"`` or ``"other"`` (a message only).
    """

    kind: str
    where: object
    field: str
    actual: object
    predicted: object


def differences(
    keys: Sequence[str],
    actual: Sequence[object],
    predicted: Sequence[object],
    where: Sequence[object],
    *,
    every_field: bool = False,
) -> Iterator[tuple[str, Discrepancy]]:
    """Each observation that differs, said as a reader would check it: its first differing
    field, or (``every_field``) each differing field of a stats snapshot."""
    for key, got, want, place in zip(keys, actual, predicted, where, strict=True):
        if same_value(got, want):
            continue
        if key.startswith("h("):
            assert isinstance(got, tuple) and isinstance(want, tuple), "handle fields"
            name, a, b = next(
                (n, a, b)
                for n, a, b in zip(HANDLE_FIELDS, got, want, strict=True)
                if not same_value(a, b)
            )
            message = f"{key} shows {name}={shown(a, b)}; the spec predicts {name}={shown(b, a)}"
            yield message, Discrepancy("observation", place, name, a, b)
            continue
        assert isinstance(got, Outcome) and isinstance(want, Outcome), "query outcomes"
        fields = _fields(key, got, want)
        for name, a, b in fields if every_field else fields[:1]:
            read = {"Stats()": "stats.", "History()": "history"}.get(key, "") + name
            read = "len(history)" if read == "historylen" else read
            said = f" ({read} is {shown(a, b)}; the spec predicts {shown(b, a)})" if name else ""
            told = f"{key} {describe(got, want)}; the spec predicts it {describe(want, got)}"
            yield told + said, Discrepancy("observation", place, name, a, b)


def _fields(key: str, got: Outcome, want: Outcome) -> list[tuple[str, object, object]]:
    """Which fields of a stats snapshot differ (or the first of a history's), with both
    values, in order; ``[("", got, want)]`` when the values are not snapshots."""
    value, predicted = getattr(got, "value", got), getattr(want, "value", want)
    if key == "History()" and isinstance(value, tuple) and isinstance(predicted, tuple):
        if len(value) != len(predicted):
            return [("len", len(value), len(predicted))]
        for i, (a, b) in enumerate(zip(value, predicted, strict=True)):
            if not same_value(a, b):
                name, x, y = _fields("Stats()", Returned(a), Returned(b))[0]
                return [(f"[{i}].{name}" if name else f"[{i}]", x, y)]
    if key == "Stats()" and isinstance(value, tuple) and isinstance(predicted, tuple):
        differing = [
            (name, a, b)
            for name, a, b in zip(model.STATS_FIELDS, value, predicted, strict=False)
            if not same_value(a, b)
        ]
        if differing:
            return differing
    return [("", value, predicted)]
