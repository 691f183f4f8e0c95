"""The machinery of the operation table: handle names, argument kinds, declarations, outcomes.

Every public call of the pool is declared once, in :mod:`.operations`, by
the :func:`operation` decorator on a frozen value class whose fields are the
call's parameters (named as in docs/API.md). The decorator records a
:class:`Declaration`: what the call returns, its transition in the spec, the
domain each value argument ranges over, where the call comes from (docs/API.md
marks **R**, **C** and **P**) and the contract rules it is judged by. Every
layer derives from these declarations rather than listing the calls again:

- the spec's side of a call: :func:`spec_call` and :func:`spec_outcome`;
- the pool's side: :func:`bind` (an invocation on any object with the API's
  names) and the outcome encoding in ``veloxquant_mlx.testing.sides``;
- what is compared after every step: :func:`observation_ops`;
- the trace format, the checkers' generators and the command lines, which
  read :func:`declarations`.

A handle has one name everywhere outside the spec's state: :class:`Handle`,
"the ``position``-th block returned by the call labelled ``call``". The
spec numbers handles by checkout order instead (``model.HandleId``); each
checker keeps the map between the two.

Complexity: O(arguments) per call, plus the transition. Thread safety:
immutable values and pure functions; the registry is filled at import.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from typing import Final, Literal, NamedTuple, TypeAlias, TypeVar, cast, get_type_hints

from veloxquant_mlx_spec.model import (
    STATS_FIELDS,
    Err,
    ErrorKind,
    ForeignBlock,
    HandleArg,
    HandleId,
    NotABlock,
    NotAList,
    PoolState,
    SpecConfig,
    is_int,
)

__all__ = [
    "UNKNOWN_CALL",
    "ArgKind",
    "AsTuple",
    "Declaration",
    "Domain",
    "Handle",
    "HandleList",
    "HandleRef",
    "Outcome",
    "Parameter",
    "Raised",
    "Returned",
    "Returns",
    "bind",
    "declaration_named",
    "declaration_of",
    "declarations",
    "h",
    "handle_names",
    "matches",
    "named_values",
    "observation_ops",
    "operation",
    "query",
    "returned_blocks",
    "same_value",
    "spec_call",
    "spec_outcome",
    "stats_values",
]


# ---- handle names ----------------------------------------------------------------------


class Handle(NamedTuple):
    """The ``position``-th block returned by the call labelled ``call``; JSON ``[call, position]``.

    Labels are any distinct ints (a step number, a stress op id), so calls
    can be dropped or reordered without renaming. The name stays valid after
    its block is freed: it then names the stale handle. A named tuple: hashed
    and compared by the interpreter itself (so CrossHair can run it).
    """

    call: int
    position: int

    def __repr__(self) -> str:
        if self.call == UNKNOWN_CALL:  # no call returned it: position is only a tag
            return f"<a handle no call returned, #{self.position}>"
        return f"h({self.call}, {self.position})"


def h(call: int, position: int) -> Handle:
    """``Handle(call, position)``, short, as reports print it."""
    return Handle(call, position)


#: The ``call`` of a name given to a ``Block`` that no recorded call returned.
UNKNOWN_CALL: Final = -1

HandleRef: TypeAlias = Handle | ForeignBlock | NotABlock
"""What a call passes where a ``Block`` is expected: a named handle, a block this pool never
handed out (another pool's live one, or one built by hand), or something that is no block."""


@dataclass(frozen=True, slots=True)
class AsTuple:
    """A list-of-blocks argument passed as a tuple (the contract accepts both)."""

    refs: tuple[HandleRef, ...]


HandleList: TypeAlias = tuple[HandleRef, ...] | AsTuple | NotAList
"""What a call passes where a ``list[Block]`` is expected (a list, a tuple, or neither)."""


class ArgKind(Enum):
    """How an argument reaches the pool: as it is, as one handle, or as a list of handles."""

    VALUE = "value"
    HANDLE = "handle"
    HANDLES = "handles"


# ---- what a call returns, and outcomes -------------------------------------------------


class Returns(Enum):
    """What a successful call returns; it decides how the result is named and compared."""

    NOTHING = "nothing"  # None
    NEW_HANDLES = "new_handles"  # handles never seen before, named h(call, 0), h(call, 1)...
    HANDLES = "handles"  # existing handles, by name, in order
    #: One handle: the argument itself, or a new one named h(call, 0); compared by block id.
    HANDLE = "handle"
    VALUE = "value"  # an int or a bool, compared with same_value (True is not 1)
    STATS = "stats"  # one snapshot: stats_values()
    HISTORY = "history"  # snapshots, oldest first: one stats_values() each
    METRICS = "metrics"  # Prometheus text: its (sample, value) pairs, sorted


def same_value(a: object, b: object) -> bool:
    """Whether ``a`` and ``b`` are equal and of one class all through: ``True`` is not ``1``
    and ``1`` is not ``1.0``, so a port that answers ``1`` where docs/API.md types a
    ``bool`` (C-NAMES) differs from the spec, which answers ``True``.

    Tuples and lists (exactly those classes) are compared item by item; anything
    else with its own ``==`` once its class is the other's (an outcome's ``==`` is
    this one). What every checker compares outcomes and observations with.
    """
    if a is b:
        return True
    kind = a.__class__
    if kind is not b.__class__:
        return False
    if kind is not tuple and kind is not list:
        return a == b
    return _same_items(cast("Sequence[object]", a), cast("Sequence[object]", b))


def _same_items(a: Sequence[object], b: Sequence[object]) -> bool:
    """:func:`same_value` of two tuples (or lists): the items' classes and values are
    compared by the interpreter first (an observation is compared after every step);
    then the nested tuples and lists once more, as ``==`` compares their items loosely."""
    kinds = list(map(type, a))
    if kinds != list(map(type, b)) or a != b:
        return False
    if tuple not in kinds and list not in kinds:
        return True
    return all(
        same_value(x, y)
        for x, y, kind in zip(a, b, kinds, strict=True)
        if kind is tuple or kind is list
    )


@dataclass(frozen=True, slots=True)
class Returned:
    """The call returned ``value``, in its comparable form (:class:`Returns`).

    Two are equal when their values are the same value of the same type
    (:func:`same_value`): ``Returned(1) != Returned(True)``.
    """

    value: object = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Returned):
            return NotImplemented
        return same_value(self.value, other.value)

    def __hash__(self) -> int:  # consistent: the same value hashes alike, whatever its type
        return hash(self.value)


@dataclass(frozen=True, slots=True)
class Raised:
    """The call raised an exception of class ``kind`` (its ``__name__``).

    ``message`` is for people: outcomes compare by ``kind`` only.
    """

    kind: str
    message: str = field(default="", compare=False)
    #: The exception itself, when a pool raised it (its text is read only to report it).
    cause: BaseException | None = field(default=None, compare=False, repr=False)

    def text(self) -> str:
        """The message, or the exception's text."""
        return self.message or ("" if self.cause is None else str(self.cause))


Outcome: TypeAlias = Returned | Raised


#: A recorded outcome that says "it returned" without saying what (an old trace's ``ok``).
class _AnyValue:
    def __repr__(self) -> str:
        return "ANY_VALUE"


ANY_VALUE: Final = _AnyValue()


def matches(recorded: Outcome | None, actual: Outcome) -> bool:
    """Whether ``actual`` is what was recorded (``None``: nothing was, so anything is)."""
    if recorded is None:
        return True
    if isinstance(recorded, Returned) and recorded.value is ANY_VALUE:
        return isinstance(actual, Returned)
    return recorded == actual


_READ_STATS: Final = operator.attrgetter(*STATS_FIELDS)
#: Per class of stats object, which of STATS_FIELDS are methods there (found once).
_METHODS_OF: dict[type, tuple[bool, ...]] = {}


def stats_values(stats: object) -> tuple[float, ...]:
    """A stats snapshot (the spec's ``StatsView`` or a pool's) as ``model.STATS_FIELDS`` values.

    A field that is a method on the object (``blocks_in_use``, ``fragmentation``) is called.
    """
    values = _READ_STATS(stats)
    methods = _METHODS_OF.get(type(stats))
    if methods is None:
        methods = _METHODS_OF[type(stats)] = tuple(map(callable, values))
    return tuple(v() if method else v for v, method in zip(values, methods, strict=True))


# ---- domains ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Domain:
    """What a value argument ranges over; every generator draws from these examples.

    Attributes:
        name: Shown in messages.
        good: Valid values a random generator draws from (Hypothesis, the stress mix).
        small: The few valid values a small-scope search tries (exhaustive, CrossHair).
        bad: Values the contract rejects, most telling first; each is JSON-encodable.
        observed: Where lockstep observes a query over this argument after every step:
            ``"every"`` good value, the values ``"named"`` by calls so far, or ``"never"``.
    """

    name: str
    good: Callable[[SpecConfig], tuple[object, ...]]
    small: Callable[[SpecConfig], tuple[object, ...]]
    bad: Callable[[SpecConfig], tuple[object, ...]]
    observed: Literal["every", "named", "never"] = "never"


# ---- declarations ----------------------------------------------------------------------

#: docs/API.md's mark: from the reference (R), added by the contract (C), a project addition (P).
Source = Literal["R", "C", "P"]
#: What a call is made on: the pool, or (for ``veloxquant_mlx.testing``'s store calls) its store.
Target = Literal["pool", "store"]


@dataclass(frozen=True, slots=True)
class Parameter:
    """One parameter of a call: its name (docs/API.md's), kind, and default (``MISSING``: none)."""

    name: str
    kind: ArgKind
    default: object = MISSING


@dataclass(frozen=True)
class Declaration:
    """Everything about one public call that a checker, a trace or a command needs.

    Invariants: ``parameters`` are the value class's fields, in order, which
    are the call's parameters as docs/API.md names them; ``transition``
    takes the spec state and then exactly those arguments, and returns the
    state after the call and its result (an ``Err`` for an error);
    ``domains`` has one entry per ``VALUE`` parameter.
    """

    op: type[object]
    name: str  # in traces and reports (the trace's "op")
    path: tuple[str, ...]  # attribute path on the pool: ("stats", "to_prometheus")
    returns: Returns
    transition: Callable[..., tuple[PoolState, object]]
    domains: Mapping[str, Domain]
    parameters: tuple[Parameter, ...]
    source: Source
    rules: tuple[str, ...]  # docs/CONTRACT.md ids this call is judged by
    target: Target = "pool"
    is_property: bool = False  # an attribute read, not a method call
    changes_state: bool = True  # False: the spec state is the same after it, whatever it gets
    counted_errors: frozenset[ErrorKind] = frozenset()  # errors that still change the state
    #: (handle parameter, value parameter): on success, a handle argument with no owner
    #: (a block built by hand) shows the value under the value parameter's name.
    sets_on_unowned: tuple[str, str] | None = None
    #: Whether every argument is a value (no handle to resolve): derived, for speed.
    values_only: bool = field(init=False, compare=False, repr=False)
    _getter: Callable[[object], tuple[object, ...]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "values_only", all(p.kind is ArgKind.VALUE for p in self.parameters)
        )
        names = [p.name for p in self.parameters]
        getter: Callable[[object], tuple[object, ...]]
        if not names:
            getter = _no_arguments
        elif len(names) == 1:
            one = operator.attrgetter(names[0])
            getter = lambda op: (one(op),)  # noqa: E731 -- a closure, built once
        else:
            getter = operator.attrgetter(*names)
        object.__setattr__(self, "_getter", getter)

    @property
    def may_issue_handles(self) -> bool:
        """Whether a successful call may hand out handles never seen before."""
        return self.returns is Returns.NEW_HANDLES or self.returns is Returns.HANDLE

    def changes_no_state(self, outcome: Outcome | None) -> bool:
        """Whether a call with this (recorded) outcome leaves the spec state as it was.

        True for queries, and for an error that does not count itself: the spec
        changes nothing on such an error (exhaustion counts itself).
        """
        if not self.changes_state:
            return True
        return isinstance(outcome, Raised) and outcome.kind not in self.counted_errors

    def arguments(self, op: object) -> tuple[object, ...]:
        """``op``'s arguments, in signature order."""
        return self._getter(op)


def _no_arguments(op: object) -> tuple[object, ...]:
    return ()


_REGISTRY: dict[type[object], Declaration] = {}
_BY_NAME: dict[str, Declaration] = {}

OpT = TypeVar("OpT")


def _parameters(cls: type[object]) -> tuple[Parameter, ...]:
    """The value class's fields as parameters; a field's type decides its kind."""
    hints = get_type_hints(cls)
    kinds = {HandleRef: ArgKind.HANDLE, HandleList: ArgKind.HANDLES}
    return tuple(
        Parameter(f.name, kinds.get(hints[f.name], ArgKind.VALUE), f.default)
        for f in fields(cls)  # type: ignore[arg-type]  # a dataclass, checked by the caller
    )


def _snake_case(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def operation(
    *,
    returns: Returns,
    transition: Callable[..., tuple[PoolState, object]],
    source: Source,
    rules: tuple[str, ...],
    domains: Mapping[str, Domain] | None = None,
    path: tuple[str, ...] | None = None,
    target: Target = "pool",
    is_property: bool = False,
    changes_state: bool = True,
    counted_errors: frozenset[ErrorKind] = frozenset(),
    sets_on_unowned: tuple[str, str] | None = None,
) -> Callable[[type[OpT]], type[OpT]]:
    """Declare the frozen dataclass it decorates as one public call (module docstring).

    The call's name (in traces and reports) is the class name in snake case
    (``MarkUsed``: ``mark_used``); it is also the attribute on the pool unless
    ``path`` gives another (``("stats", "to_prometheus")``).

    Raises:
        TypeError: At import, if the domains are not exactly the value arguments'.
    """

    def register(cls: type[OpT]) -> type[OpT]:
        parameters = _parameters(cls)
        declared = dict(domains or {})
        values = {p.name for p in parameters if p.kind is ArgKind.VALUE}
        if set(declared) != values:
            raise TypeError(
                f"{cls.__name__}: domains for {sorted(declared)}, value arguments {sorted(values)}"
            )
        name = _snake_case(cls.__name__)
        declaration = Declaration(
            op=cls,
            name=name,
            path=path or (name,),
            returns=returns,
            transition=transition,
            domains=declared,
            parameters=parameters,
            source=source,
            rules=rules,
            target=target,
            is_property=is_property,
            changes_state=changes_state,
            counted_errors=counted_errors,
            sets_on_unowned=sets_on_unowned,
        )
        if declaration.name in _BY_NAME:
            raise TypeError(f"{cls.__name__}: a call named {declaration.name!r} is declared twice")
        _REGISTRY[cls] = declaration
        _BY_NAME[declaration.name] = declaration
        return cls

    return register


def declaration_of(op: object) -> Declaration:
    """The declaration of ``op``'s class.

    Raises:
        TypeError: ``op`` is not a declared operation.
    """
    try:
        return _REGISTRY[type(op)]
    except KeyError:
        raise TypeError(f"{op!r} is not a declared operation") from None


def _declared() -> None:
    """Make sure the pool's calls are declared (importing them registers them)."""
    import veloxquant_mlx_spec.operations  # noqa: F401, PLC0415 -- it imports this module


def declaration_named(name: str) -> Declaration | None:
    """The declaration whose trace name is ``name``, if any."""
    _declared()
    return _BY_NAME.get(name)


def declarations(target: Target | None = "pool") -> tuple[Declaration, ...]:
    """Every declared call on ``target`` (``None``: all), in declaration order."""
    _declared()
    return tuple(d for d in _REGISTRY.values() if target is None or d.target == target)


def query(read: Callable[..., object]) -> Callable[..., tuple[PoolState, object]]:
    """A read-only function of the state, as a transition that keeps the state.

    The transition's ``__wrapped__`` is ``read`` itself (checkers call it directly).
    """

    def transition(state: PoolState, *arguments: object) -> tuple[PoolState, object]:
        return state, read(state, *arguments)

    return functools.update_wrapper(transition, read)  # its signature is read's


# ---- the spec's side -------------------------------------------------------------------

#: Turns a name into what the spec's transition takes: a serial, or a non-handle.
SpecResolve = Callable[[HandleRef], HandleArg]


def _handle_list(value: object, resolve: Callable[[HandleRef], object]) -> list[object]:
    refs = value.refs if isinstance(value, AsTuple) else value
    if not isinstance(refs, tuple):
        raise TypeError(f"a list of handles must be a tuple of references, got {value!r}")
    return [resolve(ref) for ref in refs]


def _resolved(
    declaration: Declaration,
    op: object,
    resolve: Callable[[HandleRef], object],
    handle_list: Callable[[object], object],
) -> list[object]:
    """``op``'s arguments: values as they are, each handle resolved, each list of handles
    (or what stands for one) passed through ``handle_list``. The one walk over a call's
    parameters, for the spec's side and the pool's."""
    arguments: list[object] = []
    for parameter, value in zip(declaration.parameters, declaration.arguments(op), strict=True):
        if parameter.kind is ArgKind.VALUE:
            arguments.append(value)
        elif parameter.kind is ArgKind.HANDLE:
            arguments.append(resolve(value))  # type: ignore[arg-type]  # a HandleRef field
        else:
            arguments.append(handle_list(value))
    return arguments


def spec_arguments(
    declaration: Declaration, op: object, resolve: SpecResolve
) -> tuple[object, ...]:
    """``op``'s arguments as the spec's transition takes them (handles as serials)."""
    if declaration.values_only:
        return declaration.arguments(op)

    def handle_list(value: object) -> object:  # the spec judges NotAList itself
        return value if isinstance(value, NotAList) else tuple(_handle_list(value, resolve))

    return tuple(_resolved(declaration, op, resolve, handle_list))


def handle_names(op: object) -> tuple[Handle, ...]:
    """Every handle name ``op`` passes, in argument order (references that name no
    handle, such as a block built by hand, are left out)."""
    declaration = declaration_of(op)
    if declaration.values_only:
        return ()
    names: list[Handle] = []

    def note(ref: HandleRef) -> HandleRef:
        if isinstance(ref, Handle):
            names.append(ref)
        return ref

    def note_list(value: object) -> object:
        return value if isinstance(value, NotAList) else _handle_list(value, note)

    _resolved(declaration, op, note, note_list)
    return tuple(names)


def spec_call(state: PoolState, op: object, resolve: SpecResolve) -> tuple[PoolState, object]:
    """Apply ``op`` to the spec: the state after it, and its result or ``Err``.

    Handle results are spec serials; :func:`spec_outcome` names them.
    """
    declaration = declaration_of(op)
    return declaration.transition(state, *spec_arguments(declaration, op, resolve))


def returned_blocks(declaration: Declaration, value: object) -> list[object]:
    """The objects a pool's successful call handed out that may be new, as a list.

    A list for ``NEW_HANDLES``; the one object for ``HANDLE`` (the caller skips
    it if it already has a name: ``make_writable`` returned its argument).
    """
    if declaration.returns is Returns.HANDLE:
        return [] if value is None else [value]
    return value if declaration.may_issue_handles and isinstance(value, list) else []


def issued(before: PoolState, after: PoolState) -> range:
    """The serials of the handles a call issued: those at or past ``before``'s count."""
    return range(len(before.handles), len(after.handles))


def spec_outcome(
    declaration: Declaration,
    after: PoolState,
    result: object,
    name_of: Callable[[HandleId], Handle],
) -> Outcome:
    """The spec's result in the form both sides are compared in (:class:`Returns`)."""
    if isinstance(result, Err):
        return Raised(result.kind.value, result.message)
    returns = declaration.returns
    if returns is Returns.NEW_HANDLES:
        assert isinstance(result, tuple), "handle results are serials"
        return Returned(tuple(after.handles[serial].block_id for serial in result))
    if returns is Returns.HANDLES:
        assert isinstance(result, tuple), "handle results are serials"
        return Returned(tuple(name_of(serial) for serial in result))
    if returns is Returns.HANDLE:
        assert is_int(result), "a handle result is a serial"
        return Returned(after.handles[result].block_id)
    if returns is Returns.STATS:
        return Returned(stats_values(result))
    if returns is Returns.HISTORY:
        assert isinstance(result, tuple), "a history is a tuple of views"
        return Returned(tuple(stats_values(view) for view in result))
    return Returned(result)


# ---- the pool's side -------------------------------------------------------------------

#: Turns a name into the object passed to the pool: a handle, a foreign block, or junk.
PoolResolve = Callable[[HandleRef], object]


def bind(target: object, op: object, resolve: PoolResolve) -> Callable[[], object]:
    """The call ``op`` on ``target`` (a pool, or a store for store calls), ready to make.

    Arguments are resolved now, so that a caller timing the call (the stress
    runner) times only the call. A list of handles is passed as a list, a
    tuple for :class:`AsTuple`, and a bare hand-made block for ``NotAList``.
    """
    declaration = declaration_of(op)
    *through, last = declaration.path
    if declaration.is_property:
        return lambda: getattr(_follow(target, through), last)
    if declaration.values_only and not through:
        method, values = getattr(target, last), declaration.arguments(op)
        return lambda: method(*values)

    def handle_list(value: object) -> object:
        if isinstance(value, NotAList):
            return resolve(ForeignBlock(None))
        if isinstance(value, AsTuple):
            return tuple(_handle_list(value, resolve))
        return _handle_list(value, resolve)

    arguments = _resolved(declaration, op, resolve, handle_list)
    if not through:  # the usual case: bind the method now, so the call is all that is timed
        method = getattr(target, last)
        return lambda: method(*arguments)
    return lambda: getattr(_follow(target, through), last)(*arguments)


def _follow(target: object, attributes: Sequence[str]) -> object:
    """``target.a.b`` for ``attributes == ["a", "b"]``, read when the call is made."""
    for attribute in attributes:
        target = getattr(target, attribute)
    return target


# ---- what is compared after every step --------------------------------------------------


#: Per call, the positions of its arguments observed at the values named so far (owners).
_NAMED: dict[str, tuple[int, ...]] = {}


def named_values(op: object) -> tuple[int, ...]:
    """The ints ``op`` passes for parameters observed at the values named (its owners)."""
    declaration = declaration_of(op)
    positions = _NAMED.get(declaration.name)
    if positions is None:
        positions = _NAMED[declaration.name] = tuple(
            i
            for i, parameter in enumerate(declaration.parameters)
            if parameter.name in declaration.domains
            and declaration.domains[parameter.name].observed == "named"
        )
    if not positions:
        return ()
    arguments = declaration.arguments(op)
    return tuple(value for i in positions if is_int(value := arguments[i]))


def observation_ops(
    config: SpecConfig, owners: Iterable[int], handles: Sequence[Handle]
) -> list[object]:
    """The queries compared after every step, each at every point it is observed at.

    A query is observed when each of its parameters has observation points:
    a domain observed at ``"every"`` good value (streams) or at the values
    ``"named"`` so far (``owners``), or a handle (every one of ``handles``).
    Queries with a parameter of neither kind (a list of handles, a prefix) are
    compared only when a checker calls them.
    """
    named = tuple(owners)
    observed: list[object] = []
    for declaration in declarations("pool"):
        if declaration.changes_state:
            continue
        points: list[tuple[object, ...]] = [()]
        for parameter in declaration.parameters:
            if parameter.kind is ArgKind.HANDLE:
                values: tuple[object, ...] = tuple(handles)
            elif parameter.kind is ArgKind.HANDLES:
                break
            else:
                domain = declaration.domains[parameter.name]
                if domain.observed == "never":
                    break
                values = domain.good(config) if domain.observed == "every" else named
            points = [(*point, value) for point in points for value in values]
        else:
            observed.extend(declaration.op(*point) for point in points)
    return observed
