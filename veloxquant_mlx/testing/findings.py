"""Findings: one deviation of a port from the contract, named by the rule it breaks.

A :class:`Finding` is what a conformance report lists: the docs/CONTRACT.md
rule (:func:`rule_of` works it out from what differed), the call it showed
after, the field that differs with both values, and the calls that show it.
Two findings with the same :attr:`Finding.key` (rule, call, field) are the
same deviation, seen on two paths; a report keeps the shortest.

Complexity: O(calls) per finding. Thread safety: immutable values and pure functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field

from veloxquant_mlx.testing.differences import Discrepancy
from veloxquant_mlx.testing.lockstep import ConformanceError
from veloxquant_mlx.testing.masking import Masking
from veloxquant_mlx.testing.sides import NoAttribute, differs_in_type_only
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.operations import (
    Allocate,
    BlocksFor,
    Free,
    FreeAll,
    History,
    MarkUsed,
    NCopyOnWrite,
    NShares,
    Prometheus,
    RegisterOwner,
    ReleaseOwner,
    SharedBlocks,
    Shrink,
    Stats,
)
from veloxquant_mlx_spec.table import ArgKind, AsTuple, Handle, Raised, Returned, declaration_of

__all__ = [
    "CONTRACT",
    "Finding",
    "finding_from_error",
    "masking_for",
    "relabelled",
    "rule_link",
    "rule_of",
]

#: Where the rules are, relative to the repository root.
CONTRACT = "docs/CONTRACT.md"

#: The rule each stats field is counted by.
STATS_RULES = {
    "n_blocks": "C-STATS-NBLOCKS",
    "n_allocations": "C-COUNTERS-ALLOC",
    "n_reused": "C-COUNTERS-ALLOC",
    "n_exhausted": "C-ALL-OR-NOTHING",
    "n_grown": "C-GROW-EXACT",
    "n_frees": "C-COUNTERS-NFREES",
    "n_retired": "C-SHRINK-COUNTS",
    "peak_blocks_in_use": "C-COUNTERS-ALLOC",
    "blocks_in_use": "C-STATS-IN-USE",
    "fragmentation": "C-STATS-FRAGMENTATION",
}
#: The sharing counters, each a query of its own, and the rule that counts them all.
SHARING_COUNTERS = (SharedBlocks, NShares, NCopyOnWrite)
SHARING_RULE = "C-COUNTERS-SHARE"
#: The rule a bad value of each parameter breaks, per call ("*": any call).
ARGUMENT_RULES = {
    ("*", "stream"): "C-STREAM-NAMES",
    ("*", "prefix"): "C-PROMETHEUS",
    ("shrink", "target_free"): "C-SHRINK-ARGS",
    ("allocate", "*"): "C-ALLOC-ARGS",
    ("mark_used", "*"): "C-MARK-USED-ARGS",
    ("*", "owner"): "C-TYPE-VS-VALUE",
}
#: A handle field that differs, and the rule about it.
HANDLE_RULES = {
    "block_id": "C-HANDLE-PER-CHECKOUT",
    "stream": "C-STREAM-SHARED",
    "format": "C-ALLOC-ARGS",
    "n_used": "C-MARK-USED-LIVE",
    "owner": "C-FREED-BLOCK",
    "ever_allocated": "C-COUNTERS-ALLOC",
}


def masking_for(
    rules: Iterable[str], seen: Callable[[Sequence[ConformanceError]], None]
) -> Masking | None:
    """The masking that lets the observations of the allowed ``rules`` pass (whole rules:
    an entry naming a call or field is matched, never masked); ``None`` if none shows in
    an observation."""
    rules = set(rules)
    fields = frozenset(name for name, rule in STATS_RULES.items() if rule in rules)
    sharing = SHARING_RULE in rules
    queries: set[type] = set(SHARING_COUNTERS if sharing else ())
    queries |= {History} if "C-HISTORY" in rules else set()
    queries |= {Prometheus} if "C-PROMETHEUS" in rules else set()
    if not (fields or queries):
        return None
    samples = {model.STATS_SAMPLES[name] for name in fields}
    samples |= set(model.SHARING_SAMPLES if sharing else ())
    return Masking(fields, frozenset(samples), frozenset(queries), seen)


def rule_link(rule: str) -> str:
    """Where ``rule`` is written: ``docs/CONTRACT.md#c-lifo``."""
    return f"{CONTRACT}#{rule.lower()}"


@dataclass(frozen=True)
class Finding:
    """One deviation: a rule, the call it showed after, the field that differs, both values.

    Invariant: ``calls`` (labelled 0, 1, ... in order, on a pool of ``config``)
    show it on a fresh pool; a finding of a check outside any sequence has no
    calls and gives its own ``python`` lines instead.
    """

    rule: str
    call: str  # the call (its table name) or the check that showed it
    field: str  # what differs: "stats.n_frees", "h(0, 1).owner", "outcome"
    actual: object
    expected: object
    calls: tuple[object, ...] = ()
    config: model.SpecConfig | None = None
    history_len: int = 1024
    python: tuple[str, ...] = ()  # the reproduction, for a finding with no calls
    source: str = ""  # which check found it: "exhaustive separate-4", "random", ...
    detail: str = dataclass_field(default="", compare=False)  # internals, shown with -v
    discrepancy: Discrepancy | None = dataclass_field(default=None, compare=False)

    @property
    def key(self) -> tuple[str, str, str]:
        """What makes two findings the same deviation."""
        return (self.rule, self.call, self.field)


def relabelled(trace: Sequence[tuple[int, object]]) -> tuple[object, ...]:
    """The calls of ``trace`` as if labelled 0, 1, ... (handle names follow their call).

    A handle named after a call that is not in ``trace`` keeps its name.
    """
    position = {label: index for index, (label, _) in enumerate(trace)}

    def rename(ref: object) -> object:
        if isinstance(ref, Handle) and ref.call in position:
            return Handle(position[ref.call], ref.position)
        return ref

    calls: list[object] = []
    for _, op in trace:
        declaration = declaration_of(op)
        arguments = zip(declaration.parameters, declaration.arguments(op), strict=True)
        calls.append(declaration.op(*(_renamed(p.kind, v, rename) for p, v in arguments)))
    return tuple(calls)


def _renamed(kind: ArgKind, value: object, rename: Callable[[object], object]) -> object:
    if kind is ArgKind.HANDLE:
        return rename(value)
    if kind is ArgKind.HANDLES and isinstance(value, tuple):
        return tuple(map(rename, value))
    if kind is ArgKind.HANDLES and isinstance(value, AsTuple):
        return AsTuple(tuple(map(rename, value.refs)))  # type: ignore[arg-type]
    return value


def finding_from_error(error: ConformanceError, source: str) -> Finding:
    """The finding a lockstep failure is: its rule, call and field, and its calls."""
    discrepancy = error.discrepancy
    calls = relabelled(error.trace)
    last = calls[-1] if calls else None
    rule, call, where = rule_of(discrepancy, last, error.config or model.SpecConfig())
    actual = expected = None
    if discrepancy is not None:
        actual, expected = discrepancy.actual, discrepancy.predicted
    return Finding(
        rule=rule,
        call=call,
        field=where,
        actual=actual,
        expected=expected,
        calls=calls,
        config=error.config,
        history_len=error.history_len,
        source=source,
        detail=str(error),
        discrepancy=discrepancy,
    )


def rule_of(
    discrepancy: Discrepancy | None, last: object | None, config: model.SpecConfig
) -> tuple[str, str, str]:
    """``(rule, call, field)`` for what differed after the call ``last`` on a pool of ``config``."""
    call = "" if last is None else declaration_of(last).name
    if discrepancy is None:
        return ("KIT", call, "message")
    if isinstance(discrepancy.actual, NoAttribute):
        missing = discrepancy.actual
        return ("C-NAMES", missing.owner.split("[")[0], missing.name)
    if isinstance(discrepancy.actual, Raised) and discrepancy.actual.kind == "AttributeError":
        return ("C-NAMES", _name(discrepancy.where), "attribute")
    if differs_in_type_only(discrepancy.actual, discrepancy.predicted):
        return _type_rule(discrepancy)
    if discrepancy.kind == "observation":
        return _observation_rule(discrepancy, last, call)
    return _outcome_rule(discrepancy, config)


def _type_rule(discrepancy: Discrepancy) -> tuple[str, str, str]:
    """A value equal to the spec's but of another type (``1`` for ``True``, ``2.0`` for
    ``2``): docs/API.md types it (C-NAMES). Keyed by what shows it, not by the call it
    showed after, so that every path to it is one finding."""
    where, name = discrepancy.where, discrepancy.field
    if isinstance(where, Handle):
        return ("C-NAMES", "block", f"{name} type")
    if isinstance(where, Stats | History) and name:
        return ("C-NAMES", "stats", f"{name.rpartition('.')[2]} type")
    return ("C-NAMES", _name(where), "returned type")


def _name(op: object) -> str:
    try:
        return declaration_of(op).name
    except TypeError:
        return repr(op)


def _observation_rule(discrepancy: Discrepancy, last: object, call: str) -> tuple[str, str, str]:
    where, name = discrepancy.where, discrepancy.field
    if isinstance(where, Handle):
        rule = HANDLE_RULES.get(name, "C-HANDLE-PER-CHECKOUT")
        if name in ("owner", "n_used") and not isinstance(last, Free | FreeAll | MarkUsed):
            rule = "C-STALE-HANDLE"  # a stale handle changed by a later checkout
        elif name == "n_used" and isinstance(last, Free | FreeAll):
            rule = "C-FREED-BLOCK"
        return (rule, call, f"handle.{name}")
    if isinstance(where, Stats):
        return (STATS_RULES.get(name, "C-STATS-SNAPSHOT"), call, f"stats.{name}")
    if isinstance(where, History):
        return ("C-HISTORY", call, "history")
    if isinstance(where, Prometheus):
        return ("C-PROMETHEUS", call, "to_prometheus")
    if isinstance(where, BlocksFor):
        return (_owner_rule(last), call, "blocks_for")
    query = _name(where)
    if isinstance(where, SHARING_COUNTERS):
        return (SHARING_RULE, call, query)
    if isinstance(last, Allocate | Free | Shrink | FreeAll):
        return (_state_rule(last, discrepancy), call, query)
    return (declaration_of(last).rules[0] if last is not None else "C-ID-SPLIT", call, query)


def _owner_rule(last: object) -> str:
    if isinstance(last, ReleaseOwner):
        return "C-RELEASE-REGISTRATION-ONLY"
    if isinstance(last, Free | FreeAll):
        return "C-FREE-ALL" if isinstance(last, FreeAll) else "C-FREE-ATOMIC"
    return "C-BLOCKS-FOR"


def _state_rule(last: object, discrepancy: Discrepancy) -> str:
    """What a wrong free count or id bound after a call that changes the pool breaks."""
    if isinstance(last, Allocate):
        return "C-ALL-OR-NOTHING"
    if isinstance(last, Free):
        return "C-FREE-ATOMIC"
    if isinstance(last, FreeAll):
        return "C-FREE-ALL"
    return "C-SHRINK-HIGHEST-FIRST"


def _outcome_rule(discrepancy: Discrepancy, config: model.SpecConfig) -> tuple[str, str, str]:
    op, got, want = discrepancy.where, discrepancy.actual, discrepancy.predicted
    name = _name(op)
    if discrepancy.field:  # a new handle reused, a hand-made block left unchanged
        rule = "C-MARK-USED-FREE" if isinstance(op, MarkUsed) else "C-HANDLE-PER-CHECKOUT"
        return (rule, name, discrepancy.field)
    bad_input = isinstance(want, Raised) and want.kind in ("TypeError", "ValueError")
    if isinstance(got, Raised) and isinstance(want, Raised):
        if {got.kind, want.kind} == {"TypeError", "ValueError"}:
            return ("C-TYPE-VS-VALUE", name, "error class")
        if not bad_input:
            return ("C-ERROR-CLASSES", name, "error class")
    if bad_input:  # refused late (another error) or not at all
        return (_argument_rule(op, config), name, "bad input not refused")
    if isinstance(got, Returned) and isinstance(want, Returned):
        return (_returned_rule(op, got.value, want.value), name, "returned")
    rule = _refusal_rule(op, got, want, config)
    return (rule, name, "raised" if isinstance(got, Raised) else "returned")


def _argument_rule(op: object, config: model.SpecConfig) -> str:
    """The rule a bad argument the pool did not refuse breaks (a bool first: C-INT-NOT-BOOL)."""
    declaration = declaration_of(op)
    bad: list[str] = []
    for parameter, value in zip(declaration.parameters, declaration.arguments(op), strict=True):
        domain = declaration.domains.get(parameter.name)
        if domain is None or _among(value, domain.good(config)):
            continue
        if isinstance(value, bool) and parameter.name != "prefix":
            return "C-INT-NOT-BOOL"
        bad.append(parameter.name)
    for (call, name), rule in ARGUMENT_RULES.items():
        if call in (declaration.name, "*") and any(name in (b, "*") for b in bad):
            return rule
    return "C-MARK-USED-FOREIGN" if isinstance(op, MarkUsed) else declaration.rules[0]


def _among(value: object, values: tuple[object, ...]) -> bool:
    """``value in values``, where ``True`` is not ``1`` (C-INT-NOT-BOOL)."""
    return any(type(v) is type(value) and v == value for v in values)


def _returned_rule(op: object, got: object, want: object) -> str:
    if isinstance(op, Allocate) and isinstance(got, tuple) and isinstance(want, tuple):
        if len(got) != len(want):
            return "C-ALLOC-SIZE"
        return "C-ID-ASCENDING" if sorted(got) == sorted(want) else "C-LIFO"
    if isinstance(op, Shrink):
        return "C-SHRINK-COUNTS"
    return declaration_of(op).rules[0]


def _refusal_rule(op: object, got: object, want: object, config: model.SpecConfig) -> str:
    """A call one side refused (raised) and the other did not."""
    if isinstance(op, Free):
        return "C-FREE-EMPTY" if op.blocks == () else "C-FREE-ATOMIC"
    if isinstance(op, RegisterOwner):
        return "C-REGISTER-ACTIVE-RAISES" if isinstance(want, Raised) else "C-OWNER-ACTIVE"
    if isinstance(op, MarkUsed):
        return "C-MARK-USED-FOREIGN" if isinstance(want, Raised) else "C-MARK-USED-FREE"
    if isinstance(op, Allocate):  # refusing what growth could meet breaks the growth rule
        grows = config.grow_on_exhaustion and isinstance(got, Raised)
        return "C-GROW-EXACT" if grows else "C-ALL-OR-NOTHING"
    return declaration_of(op).rules[0]
