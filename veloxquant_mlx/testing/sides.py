"""The two sides every checker compares: the spec, and a pool under test, both driven by table ops.

Each side takes the same operation values (``veloxquant_mlx_spec.operations``)
and call labels, names the handles a call returns ``h(label, i)``, and gives
each call's :class:`~veloxquant_mlx_spec.table.Outcome` in one form, so that
a checker compares the two with ``==`` (an outcome's own, which tells ``True``
from ``1`` and ``1`` from ``1.0``), and observations, a handle's fields
among them, with :func:`~veloxquant_mlx_spec.table.same_value`, the same
equality:

- :class:`SpecSide`: the executable spec's state, and the map from handle
  names to the spec's checkout serials;
- :class:`PoolSide`: an allocator (ours or a port), the objects it handed
  out by name, and how a reference that is not a name becomes an object
  (a live handle of a second pool, a block built by hand, or junk).

:func:`observe` lists what a side shows after a call (every observed query,
:func:`~veloxquant_mlx_spec.table.observation_ops`, and every handle's
fields) in one order, so two observations compare element by element.
The lockstep runner, the schedule explorer and the aliasing replay are built
on these; the stress runner uses :func:`pool_outcome` and
:func:`error_outcome` to record what its threads saw.

Complexity: one call per call, plus O(arguments); an observation is
O(queries x points + handles). Thread safety: a side is driven by one thread
at a time (a schedule's threads take turns).
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Final, Generic, TypeVar

from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.model import (
    Err,
    ForeignBlock,
    HandleArg,
    HandleId,
    NotABlock,
    PoolState,
)
from veloxquant_mlx_spec.table import (
    UNKNOWN_CALL,
    Declaration,
    Handle,
    HandleRef,
    Outcome,
    Raised,
    Returned,
    Returns,
    bind,
    declaration_of,
    returned_blocks,
    same_value,
    spec_arguments,
    spec_call,
    spec_outcome,
    stats_values,
)

__all__ = [
    "HandleFields",
    "NoAttribute",
    "PoolSide",
    "QueryPlan",
    "SpecSide",
    "UnknownHandleError",
    "differs_in_type_only",
    "error_outcome",
    "observation_keys",
    "observe",
    "parse_prometheus",
    "pool_encoder",
    "pool_outcome",
    "query_plan",
    "shown",
]

BlockT = TypeVar("BlockT")

#: What a handle shows: block_id, stream, format, n_used, owner, ever_allocated.
HandleFields = tuple[object, ...]
HANDLE_FIELDS: Final = ("block_id", "stream", "format", "n_used", "owner", "ever_allocated")
_FIELDS: Final = operator.attrgetter(*HANDLE_FIELDS)


class UnknownHandleError(LookupError):
    """A call names a handle no earlier call returned: the sequence is malformed."""


@dataclass(frozen=True, slots=True)
class NoAttribute:
    """What a pool shows where docs/API.md names an attribute its object lacks (C-NAMES).

    Compared like any value, so a port without ``ever_allocated`` or ``n_grown``
    gets a finding that names the attribute, not a bare ``AttributeError``.
    """

    owner: str  # "block", "stats", "history[2]"
    name: str

    def __repr__(self) -> str:
        return f"<no attribute {self.owner}.{self.name}>"


def fields_of(block: object) -> HandleFields:
    """What a pool's handle shows; a missing field shows as :class:`NoAttribute`."""
    try:
        return _FIELDS(block)
    except AttributeError:
        return tuple(getattr(block, name, NoAttribute("block", name)) for name in HANDLE_FIELDS)


def _pool_stats(value: object, owner: str = "stats") -> object:
    """A pool's stats object as ``stats_values``; a missing field as :class:`NoAttribute`."""
    try:
        return stats_values(value)
    except AttributeError as missing:
        return NoAttribute(owner, missing.name or str(missing))


def _pool_history(value: object) -> object:
    if not isinstance(value, Iterable):
        return value
    return tuple(_pool_stats(view, f"history[{i}]") for i, view in enumerate(value))


def describe(outcome: Outcome, beside: Outcome | None = None) -> str:
    """An outcome as a reader says it: ``returned (0, 1)``, ``raised ValueError``; beside
    the other side's ``returned True``, a number of another type says its type
    (``returned 1 (int)``, :func:`shown`)."""
    if isinstance(outcome, Raised):
        text = outcome.text()
        if outcome.kind == UNREADABLE:
            return f"returned a value the kit cannot read ({text})"
        return f"raised {outcome.kind}" + (f" ({text})" if text else "")
    if isinstance(beside, Returned):
        return f"returned {shown(outcome.value, beside.value)}"
    return f"returned {outcome.value!r}"


def shown(value: object, beside: object) -> str:
    """``repr(value)``, with its type when it and ``beside`` are numbers of two types:
    ``1 (int)`` beside ``True``, ``2.0 (float)`` beside ``2``, which would otherwise read
    as the same value (docs/API.md types every number a call returns, C-NAMES)."""
    if value.__class__ is not beside.__class__ and _is_number(value) and _is_number(beside):
        return f"{value!r} ({type(value).__name__})"
    return repr(value)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Number)


def differs_in_type_only(actual: object, predicted: object) -> bool:
    """Whether two values (or outcomes) are equal to ``==`` but not the same value:
    ``1`` where the spec predicts ``True``, ``(2.0, 0)`` where it predicts ``(2, 0)``."""
    if isinstance(actual, Returned) and isinstance(predicted, Returned):
        actual, predicted = actual.value, predicted.value
    try:
        return bool(actual == predicted) and not same_value(actual, predicted)
    except Exception:  # a port's value whose == raises, or is no truth value (an array)
        return False


# ---- the spec ------------------------------------------------------------------------


class SpecSide:
    """The spec's state, with the name of every handle it issued.

    Invariant: ``names[serial]`` is the name of spec handle ``serial``, and
    ``serial_of`` is its inverse; a name in ``stale_names`` was compacted
    away (:meth:`compact`) and stands for a handle of no pool.
    """

    def __init__(self, state: PoolState) -> None:
        self.state = state
        self.names: list[Handle] = []
        self.serial_of: dict[Handle, HandleId] = {}
        self.stale_names: set[Handle] = set()

    def copy(self) -> SpecSide:
        """An independent side in the same state, with the same names."""
        twin = SpecSide(self.state)
        twin.names = list(self.names)
        twin.serial_of = dict(self.serial_of)
        twin.stale_names = set(self.stale_names)
        return twin

    def resolve(self, ref: HandleRef) -> HandleArg:
        """The spec's argument for a reference.

        Raises:
            UnknownHandleError: No call returned a handle of that name.
        """
        if not isinstance(ref, Handle):
            return ref
        serial = self.serial_of.get(ref)
        if serial is not None:
            return serial
        if ref in self.stale_names:
            return ForeignBlock(None)  # no spec call can tell a stale handle from a freed block
        raise UnknownHandleError(f"no call returned a handle {ref!r}")

    def predict(self, op: object) -> tuple[PoolState, object]:
        """The state after ``op`` and its raw result (serials for handles), without applying it."""
        return spec_call(self.state, op, self.resolve)

    def outcome(self, op: object, after: PoolState, result: object) -> Outcome:
        """The outcome of ``op`` whose prediction is ``(after, result)``."""
        return spec_outcome(declaration_of(op), after, result, self.names.__getitem__)

    def commit(self, label: int, after: PoolState) -> list[Handle]:
        """Move to ``after``; name the handles the call labelled ``label`` issued; return them."""
        count = len(after.handles) - len(self.state.handles)  # the serials issued come last
        self.state = after
        if not count:
            return []
        new = [Handle(label, i) for i in range(count)]
        for name in new:
            if name in self.serial_of or name in self.stale_names:
                raise UnknownHandleError(f"call label {label} is used twice")
            self.serial_of[name] = len(self.names)
            self.names.append(name)
        return new

    def call(self, op: object, label: int) -> Outcome:
        """Apply ``op`` labelled ``label``; its outcome."""
        after, result = self.predict(op)
        outcome = self.outcome(op, after, result)
        self.commit(label, after)
        return outcome

    def query(self, op: object) -> Outcome:
        """The outcome of a call that changes nothing (an observation)."""
        return self.ask(query_plan(op))

    def ask(self, plan: QueryPlan) -> Outcome:
        """The outcome of the query ``plan`` was made for."""
        arguments = plan.arguments
        if arguments is None:
            arguments = spec_arguments(plan.declaration, plan.op, self.resolve)
        result = plan.read(self.state, *arguments)
        if plan.plain and type(result) is not Err:
            return Returned(result)
        return spec_outcome(plan.declaration, self.state, result, self.names.__getitem__)

    def observe(self, plans: Sequence[QueryPlan], handles: Sequence[Handle]) -> list[object]:
        """Each handle's fields, then each query's outcome (see :func:`observe`)."""
        views, serial_of = self.state.handles, self.serial_of
        shown: list[object] = []
        for name in handles:
            view = views[serial_of[name]]
            shown.append((view.block_id, view.stream, view.format, view.n_used, view.owner, True))
        shown += map(self.ask, plans)
        return shown

    def live_names(self) -> list[Handle]:
        """Names of the handles checked out now, in checkout order."""
        return [self.names[serial] for serial in model.live_handles(self.state)]

    def fields(self, name: Handle) -> HandleFields:
        """What the handle ``name`` shows (a spec handle always shows ``ever_allocated``)."""
        view = self.state.handles[self.serial_of[name]]
        return (view.block_id, view.stream, view.format, view.n_used, view.owner, True)

    def compact(self) -> None:
        """Drop the stale handles from the state (they can change nothing any more)."""
        live = model.live_handles(self.state)
        if len(live) == len(self.state.handles):
            return
        kept = set(live)
        self.stale_names.update(n for serial, n in enumerate(self.names) if serial not in kept)
        handles = tuple(self.state.handles[serial] for serial in live)
        self.names = [self.names[serial] for serial in live]
        self.serial_of = {name: serial for serial, name in enumerate(self.names)}
        self.state = replace(self.state, handles=handles)


# ---- a pool --------------------------------------------------------------------------


def parse_prometheus(text: str) -> tuple[tuple[str, float], ...]:
    """The ``(sample, value)`` pairs of exposition text, sorted; with ``prometheus_client``'s
    parser when it is installed, which also rejects malformed text."""
    try:
        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
    except ImportError:  # pragma: no cover - prometheus_client is a dev dependency
        samples = [line.split() for line in text.splitlines() if line and line[0] != "#"]
        return tuple(sorted((name, float(value)) for name, value in samples))
    return tuple(
        sorted(
            (sample.name, float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        )
    )


#: The outcome of a call whose returned value the kit cannot read in the spec's form.
UNREADABLE: Final = "<unreadable value>"


def error_outcome(
    error: BaseException, names: Mapping[type[BaseException], str] | None = None
) -> Raised:
    """What a raised exception is: its class's contract name (by default its ``__name__``;
    ``names`` maps a port's own classes to the contract's), and the exception, to report it."""
    kind = type(error).__name__ if names is None else names.get(type(error), type(error).__name__)
    return Raised(kind, cause=error)


def pool_encoder(
    returns: Returns, name_of: Callable[[object], Handle] | None
) -> Callable[[object], Outcome]:
    """How a pool's return value becomes the spec's form, for a call that ``returns`` this.

    With ``name_of`` ``None``, handles a query returned are kept as the objects
    (the stress runner names them later, once every call that returned them is known).
    """
    if returns is Returns.NEW_HANDLES:
        return lambda value: Returned(
            tuple(getattr(block, "block_id", block) for block in value)
            if isinstance(value, list)
            else value
        )
    if returns is Returns.HANDLE:
        return lambda value: Returned(getattr(value, "block_id", value))
    if returns is Returns.HANDLES:
        return lambda value: Returned(
            tuple(value if name_of is None else map(name_of, value))
            if isinstance(value, list)
            else value
        )
    if returns is Returns.STATS:
        return lambda value: Returned(_pool_stats(value))
    if returns is Returns.HISTORY:
        return lambda value: Returned(_pool_history(value))
    if returns is Returns.METRICS:
        return lambda value: Returned(parse_prometheus(value) if isinstance(value, str) else value)
    return Returned


def pool_outcome(op: object, value: object, name_of: Callable[[object], Handle] | None) -> Outcome:
    """A pool's return value in the spec's form (``Returns`` of ``op``'s declaration)."""
    return pool_encoder(declaration_of(op).returns, name_of)(value)


class PoolSide(Generic[BlockT]):
    """A pool under test and every handle it handed out, by name.

    Invariants: ``objects[name]`` is the handle the call labelled
    ``name.call`` returned at ``name.position``; each is kept alive, so
    ``_names`` (by ``id``) never confuses two objects.
    """

    def __init__(
        self,
        pool: Any,
        *,
        block_type: Callable[[int], object],
        foreign_pool: Callable[[], Any],
        error_names: Mapping[type[BaseException], str] | None = None,
    ) -> None:
        """Drive ``pool``; build hand-made blocks with ``block_type``.

        ``foreign_pool`` makes the second pool whose live handles stand for
        ``ForeignBlock(owner)`` (once, when first needed).
        """
        self.pool = pool
        self.objects: dict[Handle, object] = {}
        self._names: dict[int, Handle] = {}
        self._block_type = block_type
        self._foreign_pool_factory = foreign_pool
        self._foreign_pool: Any = None
        self._foreign: dict[int, object] = {}
        self.last_hand_made: object = None  # the block built by hand for the latest call
        self._encode: dict[Returns, Callable[[object], Outcome]] = {}  # by what a call returns
        self.error_names = error_names  # the port's error classes -> the contract's names

    def error_outcome(self, error: BaseException) -> Raised:
        """What an exception this pool raised is, under the contract's class names."""
        return error_outcome(error, self.error_names)

    def resolve(self, ref: HandleRef) -> object:
        """The object a reference stands for.

        Raises:
            UnknownHandleError: No call returned a handle of that name.
        """
        if isinstance(ref, Handle):
            try:
                return self.objects[ref]
            except KeyError:
                raise UnknownHandleError(f"no call returned a handle {ref!r}") from None
        if isinstance(ref, NotABlock):
            return "not a block"
        if ref.owner is None:
            self.last_hand_made = self._block_type(0)
            return self.last_hand_made
        if ref.owner not in self._foreign:
            if self._foreign_pool is None:
                self._foreign_pool = self._foreign_pool_factory()
            self._foreign[ref.owner] = self._foreign_pool.allocate("k", 1, ref.owner)[0]
        return self._foreign[ref.owner]

    def name_of(self, block: object) -> Handle:
        """The name of a handle this pool returned; an unknown one gets ``h(UNKNOWN_CALL, id)``."""
        name = self._names.get(id(block))
        if name is not None and self.objects.get(name) is block:
            return name
        return Handle(UNKNOWN_CALL, getattr(block, "block_id", -1))

    def knows(self, block: object) -> bool:
        """Whether ``block`` is a handle this pool returned to a named call."""
        return self.name_of(block).call != UNKNOWN_CALL

    def invoke(self, op: object) -> tuple[object, BaseException | None]:
        """Make the call; its return value, or the exception it raised."""
        call = bind(self.pool, op, self.resolve)
        try:
            return call(), None
        except Exception as error:  # every error is an outcome, compared with the spec's
            return None, error

    def name(self, label: int, blocks: Sequence[object]) -> list[Handle]:
        """Name ``blocks`` (returned by the call labelled ``label``) ``h(label, i)``."""
        names = [Handle(label, i) for i in range(len(blocks))]
        for name, block in zip(names, blocks, strict=True):
            self.objects[name] = block
            self._names[id(block)] = name
        return names

    def call(self, op: object, label: int) -> Outcome:
        """Make the call labelled ``label``; name the handles it returned; its outcome."""
        value, error = self.invoke(op)
        if error is not None:
            return self.error_outcome(error)
        new = [b for b in returned_blocks(declaration_of(op), value) if not self.knows(b)]
        if new:
            self.name(label, new)
        return pool_outcome(op, value, self.name_of)

    def query(self, op: object) -> Outcome:
        """The outcome of a call that changes nothing (an observation)."""
        return self.ask(query_plan(op))

    def ask(self, plan: QueryPlan) -> Outcome:
        """The outcome of the query ``plan`` was made for."""
        try:
            if plan.arguments is None or plan.through:
                value = bind(self.pool, plan.op, self.resolve)()
            elif plan.declaration.is_property:
                value = getattr(self.pool, plan.last)
            else:
                value = getattr(self.pool, plan.last)(*plan.arguments)
        except Exception as error:  # every error is an outcome, compared with the spec's
            return self.error_outcome(error)
        return Returned(value) if plan.plain else self.encoded(plan.declaration.returns, value)

    def encoded(self, returns: Returns, value: object) -> Outcome:
        """``value``, returned by a call that ``returns`` this, in the spec's form; a value
        the kit cannot read that way (Prometheus text that does not parse, a history that
        cannot be iterated) is an outcome too, :data:`UNREADABLE`, compared with the spec's."""
        try:
            return self.encoder(returns)(value)
        except Exception as error:
            return Raised(UNREADABLE, f"{type(error).__name__}: {error}")

    def encoder(self, returns: Returns) -> Callable[[object], Outcome]:
        """How this pool's return values of a call that ``returns`` this are compared."""
        encode = self._encode.get(returns)
        if encode is None:
            encode = self._encode[returns] = pool_encoder(returns, self.name_of)
        return encode

    def observe(self, plans: Sequence[QueryPlan], handles: Sequence[Handle]) -> list[object]:
        """Each handle's fields, then each query's outcome (see :func:`observe`)."""
        objects = self.objects
        shown: list[object] = [fields_of(objects[name]) for name in handles]
        shown += map(self.ask, plans)
        return shown

    def fields(self, name: Handle) -> HandleFields:
        """What the handle ``name`` shows now."""
        return fields_of(self.objects[name])


# ---- observations --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueryPlan:
    """How a query is asked of either side, worked out once per query value."""

    op: object
    declaration: Declaration
    read: Callable[..., object]  # the spec's read: (state, *arguments) -> result
    arguments: tuple[object, ...] | None  # None: they name handles, resolved per side
    through: tuple[str, ...]  # attributes to follow on the pool before the call
    last: str
    plain: bool  # it returns a plain value (Returns.VALUE): compared as it is


_PLANS: dict[tuple[object, ...], QueryPlan] = {}
_PLANS_KEPT: Final = 4096
#: Whether plans are cached (here and in the lockstep runner's observations); off
#: inside :func:`plans_uncached`.
_CACHING: list[bool] = [True]


def plans_are_cached() -> bool:
    """Whether query plans may be looked up in (and added to) the module's caches."""
    return _CACHING[-1]


@contextmanager
def plans_uncached() -> Iterator[None]:
    """Build every plan afresh inside the block: for symbolic execution (CrossHair).

    A cache keyed by symbolic values (an owner, a token count) makes a path depend on
    what earlier iterations stored, which CrossHair rejects as non-deterministic.
    Not thread-safe: the drivers that use it run on one thread.
    """
    _CACHING.append(False)
    try:
        yield
    finally:
        _CACHING.pop()


def query_plan(op: object) -> QueryPlan:
    """The plan of query ``op``; observations ask the same few queries over and over.

    Keyed by the op's class and arguments (names and plain values) with their types,
    which the interpreter hashes itself: CrossHair cannot run a dataclass's own
    ``__hash__``.
    """
    declaration = declaration_of(op)
    values = declaration.arguments(op)
    # With the arguments' types: True == 1 == 1.0 as keys, but not as arguments.
    key = (type(op), *values, *map(type, values))
    plan = _PLANS.get(key) if plans_are_cached() else None
    if plan is None:
        transition = declaration.transition
        read = getattr(transition, "__wrapped__", None)
        if read is None:  # a call that changes state, asked for its outcome only
            read = lambda state, *arguments: transition(state, *arguments)[1]  # noqa: E731
        arguments = declaration.arguments(op) if declaration.values_only else None
        *through, last = declaration.path
        plain = declaration.returns is Returns.VALUE
        plan = QueryPlan(op, declaration, read, arguments, tuple(through), last, plain)
        if plans_are_cached():
            if len(_PLANS) > _PLANS_KEPT:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def observe(
    side: SpecSide | PoolSide[Any], plans: Sequence[QueryPlan], handles: Sequence[Handle]
) -> list[object]:
    """What ``side`` shows: each handle's fields, then each query's outcome.

    :func:`observation_keys` labels them, in the same order.
    """
    return side.observe(plans, handles)


def observation_keys(plans: Sequence[QueryPlan], handles: Sequence[Handle]) -> list[str]:
    """The labels of :func:`observe`'s values: ``h(0, 1)``, ``NFree(stream='k')``..."""
    return [*map(repr, handles), *(repr(plan.op) for plan in plans)]
