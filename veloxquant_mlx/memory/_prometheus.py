"""Prometheus text exposition of block pool statistics.

Renders gauges and counters in the text format (version 0.0.4) that a
``/metrics`` endpoint serves, each preceded by its ``# HELP`` and ``# TYPE``
lines. Used by :meth:`AllocationStats.to_prometheus`.

Complexity: O(number of metrics), independent of the pool size.
Thread safety: pure functions, no state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Literal, NamedTuple

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class Metric(NamedTuple):
    """One sample to render: its name suffix, type, help text and value."""

    suffix: str
    kind: Literal["gauge", "counter"]
    help_text: str
    # int | float, not float: mypyc would turn an int counter into a float, printed
    # "3.0" by the compiled build where the interpreted one prints "3".
    value: int | float


def require_metric_prefix(prefix: object) -> str:
    """Return ``prefix`` as a plain ``str`` if it is a valid Prometheus metric name (a
    ``str`` subclass's own ``__format__`` or ``__str__`` would otherwise decide the text).

    Raises:
        ValueError: ``prefix`` is not a ``str`` matching ``[a-zA-Z_:][a-zA-Z0-9_:]*``.
    """
    if not isinstance(prefix, str) or _METRIC_NAME.fullmatch(prefix) is None:
        raise ValueError(
            "prefix must be a valid Prometheus metric name "
            f"(matching [a-zA-Z_:][a-zA-Z0-9_:]*), got {prefix!r}"
        )
    return str.__str__(prefix)


def _format_value(value: int | float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def render(prefix: str, metrics: Sequence[Metric]) -> str:
    """Render ``metrics`` under ``prefix`` as newline-terminated exposition text.

    Counters get the conventional ``_total`` suffix in their sample name; the
    caller passes suffixes without it.
    """
    lines: list[str] = []
    for metric in metrics:
        sample = f"{prefix}_{metric.suffix}"
        if metric.kind == "counter":
            sample += "_total"
        lines.append(f"# HELP {sample} {metric.help_text}")
        lines.append(f"# TYPE {sample} {metric.kind}")
        lines.append(f"{sample} {_format_value(metric.value)}")
    return "\n".join(lines) + "\n"
