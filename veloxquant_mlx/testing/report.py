"""Every deviation of a port in one run, grouped by the contract rule it breaks.

:func:`conformance_report` keeps going after a discrepancy. It runs, in order:

1. the checks outside sequences (:mod:`~veloxquant_mlx.testing.surface`) and
   every bad argument, one call each;
2. the small-scope exhaustive search on every scope, to ``depth``, told to
   go on after a counterexample (a failing call is not followed further):
   breadth first, so each finding's first sequence is a shortest one;
3. random sequences (the conformance machine's generators, through
   Hypothesis), until ``examples`` have run or the time budget is spent;
   a finding not already known is shrunk by removing calls one at a time,
   each finding for at most ``shrink_seconds``, all of them together for
   at most :data:`SHRINK_BUDGET` (30 s).

Findings with the same key (rule, call, field) are one deviation; the
shortest sequence is kept. An allow-list marks deliberate deviations as
expected: ``{"C-HISTORY": "we keep no history"}`` (a rule), or a
``"RULE/call"`` or ``"RULE/call/field"`` prefix of a key. Parts 2 and 3 run
with the observations of the allowed whole rules masked
(:mod:`~veloxquant_mlx.testing.masking`), so that sequences go on past those
differences; any other allowed deviation ends its sequence, and the report
says so (:attr:`Report.unfollowed`).

:meth:`Report.render` prints at most about 20 lines per finding: the rule
and its link into docs/CONTRACT.md, what differs with both values, and the
calls as Python to paste; ``verbose`` adds the lockstep's own message.
:func:`check_conformance` raises ``AssertionError`` with that text unless
the port conforms (allowed deviations aside).

Complexity: the exhaustive part dominates, O(states x letters) per scope.
Thread safety: one report per thread; each builds its own pools.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from veloxquant_mlx.testing import surface
from veloxquant_mlx.testing.conformance import PoolConformanceMachine
from veloxquant_mlx.testing.exhaustive import SCOPES, Counterexample, Scope, explore, port_scope
from veloxquant_mlx.testing.findings import Finding, finding_from_error, masking_for, rule_link
from veloxquant_mlx.testing.lockstep import ConformanceError, Lockstep
from veloxquant_mlx.testing.masking import in_force
from veloxquant_mlx.testing.port import Port, as_port
from veloxquant_mlx.testing.python_text import as_python, said
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.table import Outcome, Returned

__all__ = ["Report", "check_conformance", "conformance_report"]

#: The exhaustive depth a report searches to by default: 3 calls cover most deviations
#: a port has in seconds; the command line's profiles go deeper.
DEFAULT_DEPTH: Final = 3
#: Random sequences per Hypothesis run (the time budget is checked between runs), and
#: calls per sequence.
RANDOM_CHUNK: Final = 25
RANDOM_STEPS: Final = 25
#: The longest a report shrinks one finding.
DEFAULT_SHRINK_SECONDS: Final = 20.0
#: The longest a report shrinks all its findings together (then they are shown as found).
SHRINK_BUDGET: Final = 30.0
#: What no report checks, said at the end of every one (a verdict covers the rest).
NOT_IN_SCOPE: Final = (
    "calls from several threads at once (C-THREAD-SAFE, C-LINEARIZABLE): every check "
    "here calls the pool from one thread; what an error message says (C-ERROR-MESSAGE: "
    "classes are compared, wording is free); memory the process cannot hold "
    "(C-GROW-MEMORY); imports without MLX (C-IMPORT-NO-MLX)"
)


@dataclass
class Report:
    """What one run found: deviations, expected ones, and what was checked.

    Invariant: no two findings (expected or not) share a key; each is the
    shortest sequence seen for its key.
    """

    port: Port
    findings: list[Finding] = field(default_factory=list)
    expected: list[tuple[Finding, str]] = field(default_factory=list)  # with the reason
    checked: list[str] = field(default_factory=list)  # one line per part that ran
    gaps: list[str] = field(default_factory=list)  # what could not be checked, and why
    unmatched_allow: list[str] = field(default_factory=list)  # allow-list entries, unused
    # The allowed rules that ended a sequence of calls: what the port does after one is not
    # checked (a masked one, testing.masking, ends none).
    unfollowed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    longest_shrink: float = 0.0  # seconds

    @property
    def conforms(self) -> bool:
        """No deviation outside the allow-list, and nothing left unchecked."""
        return not self.findings and not self.gaps

    @property
    def verdict(self) -> str:
        """``conforms``, ``deviates`` or ``inconclusive`` (a part could not be checked)."""
        if self.findings:
            return "deviates"
        return "inconclusive" if self.gaps else "conforms"

    def render(self, *, verbose: bool = False) -> str:
        """The report as text: a summary line, then each finding under its rule."""
        rules = sorted({f.rule for f in self.findings})
        unfollowed = self.unfollowed
        cut = f" (not followed past {', '.join(unfollowed)})" if unfollowed else ""
        lines = [
            f"{self.port.name}: {self.verdict}{cut}: {len(self.findings)} deviations under "
            f"{len(rules)} rules, {len(self.expected)} expected, {self.seconds:.1f}s "
            f"(longest shrink {self.longest_shrink:.1f}s)"
        ]
        for rule in rules:
            lines += ["", f"{rule}  {rule_link(rule)}"]
            for finding in (f for f in self.findings if f.rule == rule):
                lines += _render_finding(self.port, finding, verbose)
        if self.expected:
            lines += ["", "Expected (allow-list):"]
            lines += [f"  {f.rule} {f.call} {f.field}: {why}" for f, why in self.expected]
        if unfollowed:
            lines += [
                "",
                f"Not followed: sequences past an allowed deviation ({', '.join(unfollowed)}) "
                "end there, as past any deviation, so what the port does after one is not "
                "checked; the fewer the sequences it ends, the more a verdict covers",
            ]
        if self.gaps:
            lines += ["", "Not checked:", *(f"  {gap}" for gap in self.gaps)]
        if self.unmatched_allow:
            heading = "Allow-list entries that matched no finding (a typo, or a deviation gone):"
            lines += ["", heading, *(f"  {entry!r}" for entry in self.unmatched_allow)]
        lines += ["", f"Not in scope: {NOT_IN_SCOPE}"]
        if verbose:
            lines += ["", "Checked:", *(f"  {part}" for part in self.checked)]
        return "\n".join(lines)


def _render_finding(port: Port, finding: Finding, verbose: bool) -> list[str]:
    count = len(finding.calls)
    steps = f"{count} call{'s' if count > 1 else ''}, " if count else ""
    head = (
        f"  {finding.call or 'pool'}: {finding.field}: "
        f"pool {said(finding.actual, finding.expected)}, "
        f"spec {said(finding.expected, finding.actual)}  "
        f"({steps}found by {finding.source or 'a check'})"
    )
    if finding.python:
        code = list(finding.python)
    else:
        config = finding.config or model.SpecConfig()
        code = as_python(port, finding.calls, config, finding.history_len, finding.discrepancy)
    lines = [head, *(f"    {line}" for line in code)]
    if verbose and finding.detail:  # the lockstep's message, up to its list of calls
        detail = finding.detail.split("\ncalls so far")[0]
        lines += [f"    | {_cut(line)}" for line in detail.splitlines()]
    return lines


def _cut(line: str, width: int = 200) -> str:
    return line if len(line) <= width else f"{line[: width - 5]} ..."


class _Collector:
    """Findings by key, the shortest kept; what was allowed; the time left."""

    def __init__(self, allow: Mapping[str, str], deadline: float) -> None:
        self.allow = allow
        self.deadline = deadline
        self.by_key: dict[tuple[str, str, str], Finding] = {}
        self.ended_sequences: set[tuple[str, str, str]] = set()  # keys of findings that did
        self.masked: dict[tuple[str, str], tuple[str, str, str]] = {}  # (rule, field) -> key
        self.rule_fields: set[tuple[str, str]] = set()  # (rule, field) of every finding kept

    def knows(self, finding: Finding) -> bool:
        return finding.key in self.by_key

    def add(self, finding: Finding) -> bool:
        """Keep ``finding`` if it is new or shorter; whether it was new."""
        known = self.by_key.get(finding.key)
        if known is None or len(finding.calls) < len(known.calls):
            self.by_key[finding.key] = finding
            self.rule_fields.add((finding.rule, finding.field))
        return known is None

    def add_allowed(self, errors: Sequence[ConformanceError]) -> None:
        """Keep each of ``errors`` that the allow-list expects: the differences a masking
        let pass. One lasts past the call it showed after, so one finding per rule and
        field is kept, the shortest, and none where another part found that rule and
        field (an echo of one in a part no allowed rule covers, a history snapshot, is
        dropped)."""
        for error in errors:
            finding = finding_from_error(error, "a masked sequence")
            if self.reason(finding) is None:
                continue
            masked = (finding.rule, finding.field)
            kept = self.masked.get(masked)
            if kept is None and masked in self.rule_fields:
                continue  # found unmasked (a check outside sequences)
            if kept is not None and len(self.by_key[kept].calls) <= len(finding.calls):
                continue
            if kept is not None:
                del self.by_key[kept]
            self.masked[masked] = finding.key
            self.add(finding)

    def reason(self, finding: Finding) -> str | None:
        """Why ``finding`` is expected, if the allow-list says it is."""
        rule, call, where = finding.key
        for entry in (f"{rule}/{call}/{where}", f"{rule}/{call}", rule):
            if entry in self.allow:
                return self.allow[entry]
        return None

    def out_of_time(self) -> bool:
        return time.monotonic() >= self.deadline


# ---- the random part ------------------------------------------------------------------


class _CollectingLockstep(Lockstep):
    """A lockstep that records its first failure and then stands still (for Hypothesis)."""

    collect: ClassVar[Callable[[ConformanceError], None]]
    stopped: bool = False

    def apply(
        self, op: object, call: int | None = None, *, expect: Outcome | None = None
    ) -> Outcome:
        if self.stopped:
            return Returned(None)
        try:
            return super().apply(op, call, expect=expect)
        except ConformanceError as error:
            self.stopped = True
            type(self).collect(error)
            return Returned(None)

    def compare_observations(self) -> None:
        if self.stopped:
            return
        try:
            super().compare_observations()
        except ConformanceError as error:
            self.stopped = True
            type(self).collect(error)


def _random_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=RANDOM_STEPS,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def _random_errors(
    port: Port, examples: int, collector: _Collector, ended: list[str]
) -> tuple[list[ConformanceError], int]:
    """Failures of random sequences whose findings are not known yet (one per key), and
    how many sequences were asked for before the time ran out.

    ``ended`` is told why a run of sequences ended early, if one did.
    """
    new: dict[tuple[str, str, str], ConformanceError] = {}

    def collect(error: ConformanceError) -> None:
        finding = finding_from_error(error, "random")
        collector.ended_sequences.add(finding.key)  # known or not, it ended this one
        if not collector.knows(finding) and finding.key not in new:
            new[finding.key] = error

    lockstep_class = type(
        "RandomLockstep", (_CollectingLockstep,), {"collect": staticmethod(collect)}
    )

    class Machine(PoolConformanceMachine):
        """The conformance machine, on a lockstep that records failures and goes on."""

        def stopped(self) -> bool:
            runner = self.lockstep
            return not isinstance(runner, _CollectingLockstep) or runner.stopped

    Machine.port = port
    Machine.capabilities = port.offered
    Machine.lockstep_class = lockstep_class
    # In runs of RANDOM_CHUNK sequences, the time checked between runs only: a run whose
    # drawing depended on the clock would look flaky to Hypothesis.
    done = 0
    while done < examples and not collector.out_of_time():
        chunk = min(RANDOM_CHUNK, examples - done)
        try:
            run_state_machine_as_test(Machine, settings=_random_settings(chunk))
        except Exception as error:  # Hypothesis gave up on this run; what it found stays
            ended.append(f"{type(error).__name__}: {str(error).splitlines()[0]}")
        done += chunk
    return list(new.values()), done


def shrink(port: Port, error: ConformanceError, seconds: float) -> tuple[Finding, float]:
    """The failure with calls removed while the same finding still shows; and the time taken.

    Removes one call at a time, last first, until no single call can go or ``seconds`` pass.
    """
    start = time.monotonic()
    target = finding_from_error(error, "random")
    trace = list(error.trace)
    config, history_len = error.config or model.SpecConfig(), error.history_len
    best = error
    changed = True
    while changed and time.monotonic() - start < seconds:
        changed = False
        for index in reversed(range(len(trace))):
            if time.monotonic() - start >= seconds:
                break
            candidate = trace[:index] + trace[index + 1 :]
            failure = _replay(port, candidate, config, history_len)
            if failure is not None and finding_from_error(failure, "").key == target.key:
                trace, best, changed = list(failure.trace), failure, True
                break
    return finding_from_error(best, "random, shrunk"), time.monotonic() - start


def _replay(
    port: Port, trace: Sequence[tuple[int, object]], config: model.SpecConfig, history_len: int
) -> ConformanceError | None:
    try:
        lockstep = Lockstep(port, config, history_len)
        for label, op in trace:
            lockstep.apply(op, label)
    except ConformanceError as error:
        return error
    return None


# ---- the report -----------------------------------------------------------------------


def conformance_report(
    factory: Port | Callable[..., Any],
    *,
    allow: Mapping[str, str] | Iterable[str] = (),
    depth: int = DEFAULT_DEPTH,
    scopes: Sequence[Scope] = SCOPES,
    examples: int = 300,
    time_budget: float = 75.0,
    shrink_seconds: float = DEFAULT_SHRINK_SECONDS,
    progress: Callable[[str], None] | None = None,
    **classes: Any,
) -> Report:
    """Check ``factory``'s pools against the spec and list every deviation found.

    Args:
        factory: A port, or a factory (docs/CONFORMANCE_KIT.md).
        allow: Deliberate deviations: rule ids (or ``RULE/call[/field]``), with reasons.
        depth: How deep the exhaustive search goes on each scope.
        scopes: The small pools it searches.
        examples: Random sequences to try afterwards.
        time_budget: Seconds for the exhaustive and random parts together.
        shrink_seconds: The longest one finding is shrunk.
        progress: Told one line per part.
        classes: ``config_class``, ``block_class``, ``errors``, ``capabilities``.

    Returns:
        The report; ``report.conforms`` says whether the port passed.
    """
    capabilities = classes.pop("capabilities", None)
    port = as_port(factory, capabilities=capabilities, **classes)
    reasons = dict(allow) if isinstance(allow, Mapping) else dict.fromkeys(allow, "expected")
    start = time.monotonic()
    collector = _Collector(reasons, start + time_budget)
    report = Report(port)
    say = progress or (lambda line: None)

    for check in surface.SURFACE_CHECKS:
        _run_check(report, collector, check.__name__, functools.partial(check, port))
    _run_check(report, collector, "bad arguments", lambda: list(surface.bad_argument_calls(port)))
    say(f"checks outside sequences: {len(collector.by_key)} findings")

    with in_force(masking_for((e for e in reasons if "/" not in e), collector.add_allowed)):
        for scope in scopes:
            _explore(port, scope, depth, collector, report)
            say(f"exhaustive {scope.name}: {len(collector.by_key)} findings so far")
        if examples:
            _random_part(port, examples, shrink_seconds, collector, report)
            say(f"random: {len(collector.by_key)} findings")

    for finding in sorted(collector.by_key.values(), key=lambda f: (f.rule, len(f.calls))):
        why = collector.reason(finding)
        if why is None:
            report.findings.append(finding)
        else:
            report.expected.append((finding, why))
    unused = set(reasons) - {
        entry
        for finding, _ in report.expected
        for entry in (
            finding.rule,
            f"{finding.rule}/{finding.call}",
            f"{finding.rule}/{finding.call}/{finding.field}",
        )
    }
    report.unmatched_allow = sorted(unused)
    ended = collector.ended_sequences
    report.unfollowed = sorted({f.rule for f, _ in report.expected if f.key in ended})
    report.seconds = time.monotonic() - start
    return report


def _random_part(
    port: Port, examples: int, shrink_seconds: float, collector: _Collector, report: Report
) -> None:
    """Random sequences, each failure shrunk: into ``collector``, and said in ``report``."""
    if collector.out_of_time():
        report.gaps.append(f"random: none of {examples} sequences run: the time budget ran out")
        return
    began = time.monotonic()
    ended: list[str] = []
    errors, done = _random_errors(port, examples, collector, ended)
    searched = time.monotonic() - began
    shrinking_left = SHRINK_BUDGET
    for error in errors:
        finding, took = shrink(port, error, min(shrink_seconds, shrinking_left))
        shrinking_left = max(0.0, shrinking_left - took)
        report.longest_shrink = max(report.longest_shrink, took)
        collector.add(finding)
    report.checked.append(
        f"random: {done} of {examples} sequences of up to {RANDOM_STEPS} calls, "
        f"{searched:.1f}s; {len(errors)} new findings shrunk"
    )
    if done < examples:
        report.gaps.append(f"random: {done} of {examples} sequences run: the time budget ran out")
    report.gaps += [f"random: a run of sequences ended early: {why}" for why in ended]


def _run_check(
    report: Report, collector: _Collector, name: str, check: Callable[[], list[Finding]]
) -> None:
    try:
        for finding in check():
            collector.add(finding)
    except Exception as error:  # a port that crashes a check: said, never hidden
        report.gaps.append(f"{name}: the pool raised {type(error).__name__}: {error}")
        return
    report.checked.append(name)


def _explore(port: Port, scope: Scope, depth: int, collector: _Collector, report: Report) -> None:
    def found(counterexample: Counterexample) -> None:
        if counterexample.error is not None:
            finding = finding_from_error(counterexample.error, f"exhaustive {scope.name}")
            collector.ended_sequences.add(finding.key)
            collector.add(finding)

    scope = port_scope(port, scope)
    try:
        exploration = explore(scope, depth, port, deadline=collector.deadline, on_failure=found)
    except Exception as error:  # the pool could not be built or crashed outside a call
        report.gaps.append(f"exhaustive {scope.name}: {type(error).__name__}: {error}")
        return

    if exploration.counterexample is not None and exploration.counterexample.error is not None:
        found(exploration.counterexample)
    figures = (
        f"{exploration.states} states, {exploration.transitions} transitions, "
        f"{exploration.seconds:.1f}s"
    )
    if exploration.gap is not None:
        report.gaps.append(f"exhaustive {scope.name}: {exploration.gap}")
        report.checked.append(f"exhaustive {scope.name}: stopped early, {figures}")
    else:
        report.checked.append(
            f"exhaustive {scope.name}: every sequence up to {depth} calls not past a "
            f"finding, {figures}"
        )


def check_conformance(
    factory: Port | Callable[..., Any],
    *,
    allow: Mapping[str, str] | Iterable[str] = (),
    verbose: bool = False,
    **options: Any,
) -> Report:
    """Run :func:`conformance_report`; raise ``AssertionError`` with it unless the port conforms.

    Returns:
        The report, when the port conforms (allowed deviations aside; a
        ``UserWarning`` names the rules past which sequences were not followed).
    """
    report = conformance_report(factory, allow=allow, **options)
    if not report.conforms:
        raise AssertionError(report.render(verbose=verbose))
    if report.unfollowed:
        warnings.warn(
            f"{report.port.name} conforms, but sequences past an allowed deviation "
            f"({', '.join(report.unfollowed)}) were not followed: what the port does after "
            "one is not checked",
            stacklevel=2,
        )
    return report
