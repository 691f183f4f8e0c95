"""The verdicts every checker gives, and the exit status each one maps to.

A checker that can give up (a linearizability window whose search ran out of
budget, a stress run whose checking time ran out, a replay of a partial
trace, a schedule exploration cut by ``max_schedules``, an exhaustive search
cut by its budget) must not say OK: it says INCONCLUSIVE and lists each
:class:`Gap`, what it did not check and why. Every command of this package
derives its exit status and its report's ``"verdict"`` from here:

======================  ======  ==============================================
verdict                 status  meaning
======================  ======  ==============================================
``ok``                  0       everything in the stated scope was checked
``violation``           1       a check failed: a real bug (or a bad store)
(bad input)             2       the command refused its input; nothing ran
``inconclusive``        3       nothing failed, but not everything was checked
``interrupted``         130     stopped by Ctrl-C (SIGINT) before the end
======================  ======  ==============================================

Bad input is an exit status, not a verdict: nothing was checked.

:func:`percent_text` writes the share of calls checked the same way everywhere.

Complexity: O(number of findings). Thread safety: immutable values.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from veloxquant_mlx.commandline.sigint import INTERRUPTED_STATUS

__all__ = [
    "ExitStatus",
    "Gap",
    "Verdict",
    "combined",
    "percent_text",
    "verdict_of",
    "why_cut_short",
]


class ExitStatus(enum.IntEnum):
    """The process exit status of every command (see the module docstring)."""

    OK = 0
    VIOLATION = 1
    BAD_INPUT = 2
    INCONCLUSIVE = 3
    INTERRUPTED = INTERRUPTED_STATUS  # 128 + SIGINT, as a shell reports a Ctrl-C


class Verdict(enum.Enum):
    """What a check concluded; ``value`` is the word used in reports and ``report.json``."""

    OK = "ok"
    VIOLATION = "violation"
    INCONCLUSIVE = "inconclusive"
    INTERRUPTED = "interrupted"

    @property
    def exit_status(self) -> ExitStatus:
        """The exit status a command ends with for this verdict."""
        return _EXIT_STATUS[self]

    @property
    def label(self) -> str:
        """The verdict as a summary line shows it: ``OK``, ``VIOLATION``..."""
        return self.name


_EXIT_STATUS = {
    Verdict.OK: ExitStatus.OK,
    Verdict.VIOLATION: ExitStatus.VIOLATION,
    Verdict.INCONCLUSIVE: ExitStatus.INCONCLUSIVE,
    Verdict.INTERRUPTED: ExitStatus.INTERRUPTED,
}


@dataclass(frozen=True)
class Gap:
    """Something a checker did not check: ``what`` (with a count) and ``why``.

    Example: ``Gap("3,731 calls (windows 289 and later)", "the search budget of
    1,000,000 configurations ran out in window 289")``.
    """

    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.what} not checked: {self.why}"

    def to_json(self) -> dict[str, str]:
        """``{"what": ..., "why": ...}``."""
        return {"what": self.what, "why": self.why}


def why_cut_short(*, interrupted: bool, stopped_at_first: bool, budget: str) -> str:
    """A :class:`Gap`'s ``why`` for an exploration that left runs undone: a Ctrl-C, its
    first violation (it was asked to stop there), or the ``budget`` option running out."""
    if interrupted:
        return "interrupted by Ctrl-C"
    if stopped_at_first:
        return "it stopped at its first violation"
    return f"the {budget} budget ran out"


def verdict_of(*, violations: int, gaps: Iterable[Gap] = (), interrupted: bool = False) -> Verdict:
    """The one verdict of a check: interrupted, else violation, else inconclusive, else OK.

    An interrupt wins so that Ctrl-C always exits 130 (a report still lists
    any violation found before it); a violation found is a definite answer
    even where other parts went unchecked.
    """
    if interrupted:
        return Verdict.INTERRUPTED
    if violations:
        return Verdict.VIOLATION
    if any(True for _ in gaps):
        return Verdict.INCONCLUSIVE
    return Verdict.OK


_PRECEDENCE = (Verdict.INTERRUPTED, Verdict.VIOLATION, Verdict.INCONCLUSIVE, Verdict.OK)


def combined(verdicts: Iterable[Verdict]) -> Verdict:
    """The verdict of several checks together: the first of interrupted, violation,
    inconclusive that any of them gave, else OK (also for no checks at all)."""
    given = set(verdicts)
    return next(verdict for verdict in _PRECEDENCE if verdict in given or verdict is Verdict.OK)


def percent_text(part: int, whole: int) -> str:
    """``part`` of ``whole`` as a percentage with one decimal, e.g. ``'62.1%'``.

    Rounded down, and never to ``100.0%`` unless ``part == whole`` nor to
    ``0.0%`` unless ``part == 0``: a report must not round "almost all
    checked" up to "all". Nothing to check (``whole == 0``) is ``100.0%``.
    """
    if whole <= 0 or part >= whole:
        return "100.0%"
    tenths = min(max(part * 1000 // whole, 1 if part > 0 else 0), 999)
    return f"{tenths // 10}.{tenths % 10}%"
