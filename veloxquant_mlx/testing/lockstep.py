"""Run an allocator and the executable spec side by side, comparing everything.

:class:`Lockstep` applies one operation of the table
(``veloxquant_mlx_spec.operations``) at a time to an allocator under test
and to the spec, compares the call's outcome (the value returned, or the
class of the error raised), then compares everything a caller can observe:
every handle's fields, and every query the table observes
(:func:`~veloxquant_mlx_spec.table.observation_ops`: stats, history,
``n_free`` of every stream, ``blocks_for`` of every owner named so far,
``is_live`` of every handle, ``id_bound``, ``check_invariants``). The first
difference raises :class:`ConformanceError`, whose message lists the calls
so far as Python a reader can paste, with handles named ``h(call, i)``;
a masking in force (:mod:`~veloxquant_mlx.testing.masking`, a conformance
report's allow-list) lets the differences of the observations it covers pass.

Calls are labelled (by default 0, 1, 2... in order); the handles a call
returns are named after its label. Nothing here knows one operation from
another: the table says what each returns and how it is called.

It is the engine behind the Hypothesis conformance machine, the small-scope
exhaustive checker, the CrossHair drivers, the schedule explorer's setup and
the aliasing replay, and what a port to another backend runs against the
spec. A port offers the calls in ``capabilities`` (by default all, the
project's additions marked **P** in docs/API.md included); a port without
them passes :data:`REFERENCE_CALLS`. Third parties (``oracles``, e.g. a
second model written by hand) may answer each call and show what they
model; they are compared with the spec too.

Complexity: O(handles issued + owners named + history) per call at
``Check.EVERYTHING``; O(live handles + ...) at ``STATE``; O(1) plus the call
at ``OUTCOMES``. Thread safety: none; one thread drives one ``Lockstep``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from enum import Enum
from typing import Any, Final, NoReturn, Protocol

from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.testing.differences import Discrepancy, differences
from veloxquant_mlx.testing.masking import MASKING
from veloxquant_mlx.testing.port import ALL_CALLS, REFERENCE_CALLS, Port
from veloxquant_mlx.testing.sides import (
    PoolSide,
    QueryPlan,
    SpecSide,
    UnknownHandleError,
    describe,
    observation_keys,
    observe,
    plans_are_cached,
    query_plan,
)
from veloxquant_mlx_spec import invariants, model
from veloxquant_mlx_spec.model import ForeignBlock, PoolState
from veloxquant_mlx_spec.operations import BlockPool
from veloxquant_mlx_spec.table import (
    Declaration,
    Handle,
    Outcome,
    Raised,
    Returns,
    declaration_of,
    matches,
    named_values,
    observation_ops,
    same_value,
    spec_outcome,
)

__all__ = [
    "ALL_CALLS",
    "REFERENCE_CALLS",
    "AllocatorFactory",
    "Check",
    "ConformanceError",
    "Lockstep",
    "Oracle",
]

#: Builds a fresh allocator for a config and a ``history_len``.
AllocatorFactory = Callable[[PoolConfig, int], BlockPool[Any]]


#: The queries observed per (config, capabilities, owners, handles): the same keys recur across
#: the many short lockstep runs of a search, so they are derived once (bounded, cleared when full).
_OBSERVED: dict[tuple[object, ...], list[QueryPlan]] = {}
_OBSERVED_KEPT: Final = 4096


class Check(Enum):
    """How much is compared after each call, beyond its outcome."""

    OUTCOMES = "outcomes"  # the outcome only (long replays)
    STATE = "state"  # plus live handles, stats, history and every observed query
    EVERYTHING = "everything"  # plus every stale handle


class ConformanceError(AssertionError):
    """The allocator and the spec disagree; the message holds a replayable sequence.

    ``discrepancy`` says what differed; ``trace`` and ``config`` are the calls
    (labelled) and the spec config up to and including the one that failed.
    """

    def __init__(
        self,
        message: str,
        discrepancy: Discrepancy | None = None,
        trace: Sequence[tuple[int, object]] = (),
        config: model.SpecConfig | None = None,
        history_len: int = 1024,
    ) -> None:
        super().__init__(message)
        self.discrepancy = discrepancy
        self.trace = tuple(trace)
        self.config = config
        self.history_len = history_len


class Oracle(Protocol):
    """A third party beside the spec: answers the calls it models, shows what it models."""

    def apply(self, op: object, label: int) -> Outcome | None:
        """The outcome it predicts for ``op`` (labelled ``label``), or ``None`` if it does not
        model the call. It is then told nothing more: such a call changes no state."""
        ...

    def observe(self) -> Mapping[str, object]:
        """Observations it models, keyed as :func:`~veloxquant_mlx.testing.sides.observe` keys."""
        ...


class Lockstep:
    """One allocator and one spec state, advanced together.

    Invariants: after every :meth:`apply` that returned, the two sides agree
    on the call's outcome and (unless ``check`` is ``OUTCOMES``) on every
    observation; ``spec.names`` and ``pool_side.objects`` name the same
    handles; ``trace`` lists every call applied, with its label.
    """

    def __init__(
        self,
        factory: AllocatorFactory | Port,
        config: model.SpecConfig,
        history_len: int = 1024,
        *,
        check: Check = Check.EVERYTHING,
        capabilities: Iterable[str] | None = None,
        oracles: Sequence[Oracle] = (),
    ) -> None:
        """Build the allocator and the spec's initial state.

        Args:
            factory: Makes the allocator under test (and a second, foreign one); a
                :class:`~veloxquant_mlx.testing.port.Port` also gives the port's block and
                error classes and its capabilities.
            config: A valid spec config; its ``PoolConfig`` twin is built here.
            history_len: Passed to both.
            check: What is compared after each call.
            capabilities: The calls the allocator offers (default: the port's, or all).
            oracles: Third parties compared with the spec after every call.
        """
        state = model.new_pool(config, history_len)
        if isinstance(state, model.Err):
            raise ValueError(f"history_len {history_len!r} is rejected by the spec: {state}")
        pool_config = PoolConfig(**asdict(config))  # the spec's twin: the same fields
        # A bare factory offers every call unless told.
        port = factory if isinstance(factory, Port) else Port(factory, capabilities=ALL_CALLS)
        make = port.allocator_factory()
        pool = make(pool_config, history_len)
        self.spec: Final = SpecSide(state)
        self.pool_side: Final = PoolSide[object](
            pool,
            block_type=port.block_class,
            foreign_pool=lambda: make(PoolConfig(block_size=4, n_blocks=64), history_len),
            error_names=port.error_names(pool) if port.errors is not None else None,
        )
        self.check: Final = check
        self.capabilities: Final = frozenset(port.offered if capabilities is None else capabilities)
        # Third parties still compared: one that does not model a call which changed the
        # spec's state (sharing, for a model older than it) can no longer be, and leaves.
        self.oracles: list[Oracle] = list(oracles)
        self.trace: list[tuple[int, object]] = []
        self.owners_named: set[int] = set()
        # The allow-list's observations to let pass (testing.masking), if a report set one.
        self.masking: Final = MASKING.get()

    @property
    def state(self) -> PoolState:
        """The spec's state after the calls so far."""
        return self.spec.state

    @property
    def pool(self) -> Any:
        """The allocator under test."""
        return self.pool_side.pool

    def next_label(self) -> int:
        """The label :meth:`apply` gives a call by default: its position in the trace."""
        return len(self.trace)

    # -- applying operations -------------------------------------------------------------

    def apply(
        self, op: object, call: int | None = None, *, expect: Outcome | None = None
    ) -> Outcome:
        """Apply ``op`` to both sides; compare its outcome, then (per ``check``) everything.

        Args:
            op: An operation of the table.
            call: Its label (default: its position in ``trace``).
            expect: An outcome recorded for it (a trace's), which the pool must give too.

        Returns:
            The outcome both sides gave.

        Raises:
            ConformanceError: The two sides (or the recorded outcome) disagree, or ``op``
                names a handle no earlier call returned.
        """
        label = self.next_label() if call is None else call
        self.trace.append((label, op))
        declaration = declaration_of(op)
        if declaration.name not in self.capabilities:
            self._fail(f"{declaration.name}() is not among this pool's capabilities")
        self.owners_named.update(named_values(op))
        spec, pool_side = self.spec, self.pool_side
        try:
            after, result = self._predict(op)
            predicted = spec_outcome(declaration, after, result, spec.names.__getitem__)
            value, error = pool_side.invoke(op)
        except UnknownHandleError as unknown:
            self._fail(f"malformed sequence: {unknown}")
        if error is not None:
            actual: Outcome = pool_side.error_outcome(error)
        else:
            actual = pool_side.encoded(declaration.returns, value)
        if actual != predicted or expect is not None:
            self._compare_outcome(op, declaration, actual, predicted, expect)
        if declaration.may_issue_handles and not isinstance(actual, Raised):
            self._name_new_handles(op, label, value, declaration)
        if declaration.sets_on_unowned is not None and not isinstance(actual, Raised):
            self._check_unowned(op, *declaration.sets_on_unowned)
        before = spec.state
        try:
            spec.commit(label, after)
        except UnknownHandleError as reused:
            self._fail(f"malformed sequence: {reused}")
        for oracle in tuple(self.oracles):
            theirs = oracle.apply(op, label)
            if theirs is None and not declaration.changes_no_state(actual) and after != before:
                self.oracles.remove(oracle)
            if theirs is not None and theirs != predicted:
                said = f"{oracle!r} says {op!r} {describe(theirs, predicted)}"
                self._fail(f"{said}; the spec predicts it {describe(predicted, theirs)}")
        if self.check is not Check.OUTCOMES:
            self.compare_observations()
        return actual

    def _predict(self, op: object) -> tuple[PoolState, object]:
        """The spec's side of ``op`` (a seam: the exhaustive checker replays recorded ones)."""
        return self.spec.predict(op)

    def _compare_outcome(
        self,
        op: object,
        declaration: Declaration,
        actual: Outcome,
        predicted: Outcome,
        expect: Outcome | None,
    ) -> None:
        """Refuse an outcome other than the spec's (unless a masking covers it: a query's
        only, so no state diverges) or the recorded one."""
        if actual != predicted and not self._lets_pass(op, declaration, actual, predicted):
            self._fail(
                f"{op!r} {describe(actual, predicted)}; "
                f"the spec predicts it {describe(predicted, actual)}",
                Discrepancy("outcome", op, "", actual, predicted),
            )
        if expect is not None and not matches(expect, actual):
            self._fail(f"{op!r} {describe(actual)}; the trace records it {describe(expect)}")

    def _name_new_handles(
        self, op: object, label: int, value: object, declaration: Declaration
    ) -> None:
        """The handles a call returned must be new objects; they are named ``h(label, i)``.

        A call returning one handle (``make_writable``) may return its argument:
        that object keeps its name (the spec compared its block id already).
        """
        if declaration.returns is Returns.HANDLE:
            if value is not None and not self.pool_side.knows(value):
                self.pool_side.name(label, [value])
            return
        if not isinstance(value, list):
            self._fail(
                f"{op!r} returned {value!r}; the spec predicts a list of handles",
                Discrepancy("outcome", op, "type", type(value).__name__, "list"),
            )
        if len({id(b) for b in value}) != len(value) or any(map(self.pool_side.knows, value)):
            self._fail(
                f"{op!r} returned a handle object that was handed out before",
                Discrepancy("outcome", op, "new handle objects", "reused", "new"),
            )
        self.pool_side.name(label, value)

    def _check_unowned(self, op: object, handle: str, value: str) -> None:
        """A call on a block built by hand changes that object only (C-MARK-USED-FREE)."""
        ref = getattr(op, handle)
        if isinstance(ref, ForeignBlock) and ref.owner is None:
            shown = getattr(self.pool_side.last_hand_made, value, None)
            if not same_value(shown, getattr(op, value)):
                self._fail(
                    f"{op!r} left the hand-made block's {value} at {shown!r}",
                    Discrepancy("outcome", op, f"hand-made {value}", shown, getattr(op, value)),
                )

    # -- comparing -----------------------------------------------------------------------

    def observed_handles(self) -> list[Handle]:
        """The handles whose fields are compared: every one issued, or the live ones."""
        if self.check is Check.EVERYTHING:
            return list(self.spec.names)
        return self.spec.live_names()

    def observed_queries(self, handles: Sequence[Handle]) -> list[QueryPlan]:
        """The queries compared after each call (the table's, within ``capabilities``)."""
        owners = tuple(sorted(self.owners_named))
        config = self.state.config  # keyed by its fields: see sides.query_plan
        fields = (config.block_size, config.n_blocks, config.separate_kv, config.max_blocks)
        key = (*fields, config.grow_on_exhaustion, self.capabilities, owners, tuple(handles))
        queries = _OBSERVED.get(key) if plans_are_cached() else None
        if queries is None:
            every = observation_ops(self.state.config, owners, handles)
            queries = [
                query_plan(op) for op in every if declaration_of(op).name in self.capabilities
            ]
            if plans_are_cached():
                if len(_OBSERVED) > _OBSERVED_KEPT:
                    _OBSERVED.clear()
                _OBSERVED[key] = queries
        return queries

    def compare_observations(self) -> None:
        """Compare everything observable; raise :class:`ConformanceError` on a difference."""
        broken = invariants.broken_invariants(self.state)
        if broken:
            self._fail(f"the spec's own invariants broke: {broken}")
        handles = self.observed_handles()
        queries = self.observed_queries(handles)
        predicted = observe(self.spec, queries, handles)
        actual = observe(self.pool_side, queries, handles)
        if not same_value(actual, predicted):  # a handle's fields too: True is not 1
            keys = observation_keys(queries, handles)
            where = [*handles, *(plan.op for plan in queries)]
            compared = (actual, predicted)
            if self.masking is not None:
                compared = self._mask(where, keys, actual, predicted)
            if not same_value(*compared):
                message, discrepancy = next(differences(keys, *compared, where))
                self._fail(message, discrepancy)
        for oracle in self.oracles:
            ours = dict(zip(observation_keys(queries, handles), predicted, strict=True))
            for key, theirs in oracle.observe().items():
                if not same_value(theirs, ours.get(key)):
                    self._fail(f"{oracle!r} shows {key} = {theirs!r}; the spec: {ours.get(key)!r}")

    def _lets_pass(
        self, op: object, declaration: Declaration, actual: Outcome, predicted: Outcome
    ) -> bool:
        """Whether a masking covers the differing values of the query ``op`` (a call that
        changes no state)."""
        masking = self.masking
        if masking is None or declaration.changes_state:
            return False
        shown, expected = masking.compared(op, actual, predicted)
        return same_value(shown, expected)  # seen: the observation after the call shows it too

    def _mask(
        self,
        where: Sequence[object],
        keys: Sequence[str],
        actual: list[object],
        predicted: list[object],
    ) -> tuple[list[object], list[object]]:
        """Both observations with the masked parts left out; the differences those parts
        alone show are told to the masking's ``seen`` (each a ``ConformanceError``)."""
        masking = self.masking
        assert masking is not None, "called with a masking only"
        shown: list[object] = []
        expected: list[object] = []
        let_pass: list[ConformanceError] = []
        for place, key, a, p in zip(where, keys, actual, predicted, strict=True):
            same = same_value(a, p)
            compared = (a, p) if same else masking.compared(place, a, p)
            shown.append(compared[0])
            expected.append(compared[1])
            if not same and same_value(*compared):
                told = differences([key], [a], [p], [place], every_field=True)
                let_pass.extend(self._error(message, found) for message, found in told)
        if let_pass:
            masking.seen(let_pass)
        return shown, expected

    def _fail(self, message: str, discrepancy: Discrepancy | None = None) -> NoReturn:
        raise self._error(message, discrepancy)

    def _error(self, message: str, discrepancy: Discrepancy | None) -> ConformanceError:
        calls = "\n".join(
            f"  {op!r}" + ("" if label == index else f"  # call {label}")
            for index, (label, op) in enumerate(self.trace)
        )
        return ConformanceError(
            f"{message}\nconfig: {self.state.config}, history_len={self.state.history_len}\n"
            f"calls so far (handle h(c, i) is the i-th block call c returned):\n{calls}",
            discrepancy,
            self.trace,
            self.state.config,
            self.state.history_len,
        )
