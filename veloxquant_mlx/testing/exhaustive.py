"""Small-scope exhaustive check: every operation sequence up to a depth, in lockstep.

Random testing (the Hypothesis conformance machine) samples long sequences;
this checker covers all short ones. On each small pool of :data:`SCOPES`
(both stream modes, growth with a cap, up to 4 blocks, owners 0 and 1) it
explores breadth first every sequence of up to ``depth`` letters of a finite
alphabet (:func:`alphabet`), driving the allocator under test through every
transition in :class:`~veloxquant_mlx.testing.lockstep.Lockstep`, which
compares all that a caller can observe with the spec. The alphabet is
derived from the operation table (:func:`~veloxquant_mlx.testing.templates.small_scope`:
every call with its small-scope arguments, every handle shape, each
argument's first bad value) and is *relative* ("free the 2nd live handle in
checkout order", "free the handle freed last"): a letter is made concrete
against the names of the state at each node (``Free((h(0, 1),))``, the
call at depth ``d`` labelled ``d``), so a path replays exactly on a fresh
pool. One rule is the exhaustive checker's own: each owner allocates with
its own format (:data:`FORMAT_OF_OWNER`), so formats are checked without
multiplying the letters.

**Deduplication.** Nodes are merged on :func:`canonical_key`, derived from
the spec's ``PoolState``, only when every future observation is the same up
to renaming the ``Block`` objects (which a caller tells apart by identity
only). Kept verbatim: the free lists, the id books, every counter (a caller
sees absolute values, so no deltas) and the history; the registrations of
owners holding nothing (a holder is active anyway, and its registration ends
with its last block); the live handles' views in checkout order
(``blocks_for``, ``free_all`` and the letters depend on it); the view of the
handle freed last (the one stale handle a letter can still name). The other
stale handles can never change and no rule depends on their issue order, so
they are a sorted multiset.

**Merge probe.** That merge is exact for the spec, but an allocator reaching
the state by another path may hold a difference it does not show yet (a
free list in another order, a registration it forgot). So a path that is
merged away is first checked with :func:`probe`, calls that bring that
hidden state to light. Without it, a FIFO free list escapes depth 4: its
wrong order is merged into a path (``free`` then ``free_all``) it does not
affect.

**Shortest.** The search goes depth by depth: a failure at depth d is
reported at once, a probe's failure (the merged path and the probe call that
fails alone) once every shorter sequence has passed.

**Cost.** Letters that leave the spec state unchanged (errors, no-ops) run
one after another on one replay of the node's path: each outcome is compared
at once, everything else when the run ends, and a failure is re-run letter
by letter on fresh replays to name a shortest sequence. Every other letter
gets a fresh replay, which reuses the spec's recorded predictions and skips
the full comparison that path already passed.

**Budget.** A search may be given a budget of distinct states (memory) and a
deadline (time). When one runs out the search stops where it is and the
:class:`Exploration` says how far it got (every sequence up to the last
finished depth) as a :class:`~veloxquant_mlx.commandline.verdicts.Gap`: its
verdict is then inconclusive, not OK.

Command line (:mod:`~veloxquant_mlx.testing.exhaustive_command`):
``veloxquant-mlx exhaustive [--profile ci|nightly] [--depth N] [--scope
NAME]... [--max-states N] [--time-budget SECONDS] [--json] [--out DIR]``;
exit status 0 OK, 1 counterexample, 2 bad input, 3 inconclusive, 130 Ctrl-C.

Complexity: O(S x A x D) calls for S distinct states (about x8 per depth),
A letters (about 60) and depth D; memory O(S). Thread safety: none; each
:func:`explore` builds its own allocators, one per thread or process.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below load is one line too
    from veloxquant_mlx.commandline.sigint import run_program

    run_program(
        "python -m veloxquant_mlx.testing.exhaustive", "veloxquant_mlx.testing.exhaustive_command"
    )

import json
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from veloxquant_mlx.commandline.verdicts import Gap, Verdict, verdict_of
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.testing.lockstep import AllocatorFactory, ConformanceError, Lockstep
from veloxquant_mlx.testing.port import ALL_CALLS, Port
from veloxquant_mlx.testing.templates import Live, Names, Template, small_scope
from veloxquant_mlx.testing.traces import Trace, TraceLine, encode_line
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.operations import Allocate, BlockPool, RegisterOwner
from veloxquant_mlx_spec.table import ArgKind, AsTuple, Handle, declaration_of

OWNERS = (0, 1)
#: The letter shown for a call of :func:`probe` in a counterexample.
PROBE_LETTER = "(merge probe)"
#: Each owner allocates with its own format, so that formats are checked too.
FORMAT_OF_OWNER = {0: "fp16", 1: "int4"}


@dataclass(frozen=True)
class Scope:
    """One pool to explore: a name for reports, its config and ``history_len``."""

    name: str
    config: model.SpecConfig
    history_len: int


SCOPES: tuple[Scope, ...] = (
    Scope("separate-4", model.SpecConfig(2, 4, separate_kv=True), history_len=2),
    Scope("shared-4", model.SpecConfig(2, 4, separate_kv=False), history_len=2),
    Scope("separate-grow-3-to-4", model.SpecConfig(2, 3, True, True, 4), history_len=2),
    Scope("shared-grow-0-to-3", model.SpecConfig(2, 0, False, True, 3), history_len=2),
)
#: Depth (letters per sequence) of each profile.
PROFILE_DEPTHS = {"ci": 4, "nightly": 6}


def port_scope(port: Port, scope: Scope) -> Scope:
    """``scope`` with a history length ``port``'s factory can be given (its default, if it
    takes none)."""
    return replace(scope, history_len=port.history_len_for(scope.history_len))


def default_factory(config: PoolConfig, history_len: int) -> BlockPool[Any]:
    """Our own allocator, the default system under test."""
    return BlockPoolAllocator(config, history_len=history_len)


# ---- the alphabet ------------------------------------------------------------------


def _format_follows_owner(template: Template) -> bool:
    """The exhaustive checker's own rule: owner o allocates with ``FORMAT_OF_OWNER[o]``."""
    parameters = template.declaration.parameters
    named = {p.name: a for p, a in zip(parameters, template.arguments, strict=True)}
    owner, fmt = named.get("owner"), named.get("format")
    if not (model.is_int(owner) and owner in FORMAT_OF_OWNER):
        return True  # a bad owner: the call is refused whatever the format
    return fmt not in FORMAT_OF_OWNER.values() or FORMAT_OF_OWNER[owner] == fmt


def alphabet(config: model.SpecConfig) -> tuple[Template, ...]:
    """Every letter explored on a pool of ``config``, derived from the operation table.

    Every call that changes the pool; queries are left out, since every one the
    pool answers in a state is compared after each call anyway. Live handles are
    picked by position (every position a pool of this size can fill, the newest,
    and the two newest out of order), plus the handle freed last.
    """
    max_live = max(config.n_blocks, config.max_blocks or 0)
    lists: list[tuple[object, ...] | AsTuple] = [(Live(i),) for i in range(max_live)]
    lists.append((Live(-1), Live(-2)))  # two at once, not in checkout order
    letters = small_scope(
        config, handle_names=(Live(0), Live(-1)), list_names=lists, combine=True, queries=False
    )
    return tuple(letter for letter in letters if _format_follows_owner(letter))


def probe(state: model.PoolState) -> list[object]:
    """Calls that bring to light what a pool holds but does not show, at ``state``.

    ``register_owner`` of each owner holding nothing (it raises if the owner
    is registered), then per stream one allocation of every free block, which
    shows the free-list order and, through ``n_reused``, ``ever_allocated``;
    the first one also grows the pool to its cap, which shows the retired ids
    and the next id.
    """
    config = state.config
    room = 0
    if config.grow_on_exhaustion:
        n_blocks = model.stats(state).n_blocks
        room = 1 if config.max_blocks is None else config.max_blocks - n_blocks
    holding = {view.owner for view in state.handles if view.owner is not None}
    operations: list[object] = [RegisterOwner(o) for o in OWNERS if o not in holding]
    for stream, free_list in state.free_lists:
        n_blocks_wanted, room = len(free_list) + room, 0
        if n_blocks_wanted:
            owner = OWNERS[0]
            n_tokens = n_blocks_wanted * config.block_size
            operations.append(Allocate(stream, n_tokens, owner, FORMAT_OF_OWNER[owner]))
    return operations


# ---- states and their canonical key ------------------------------------------------


def canonical_key(state: model.PoolState, last_freed: model.HandleId | None) -> Hashable:
    """The dedup key: equal keys mean equal future observations, up to handle renaming.

    The module docstring explains what is kept verbatim and what is abstracted.
    """
    live = tuple(view for view in state.handles if view.owner is not None)
    holding = {view.owner for view in live}
    frozen_stale = sorted(
        (view.block_id, view.stream, view.format, view.n_used)
        for handle, view in enumerate(state.handles)
        if view.owner is None and handle != last_freed
    )
    return (
        state.free_lists,
        state.next_block_id,
        state.ever_allocated,
        state.retired,
        state.registered - holding,  # a holder's registration ends with its last block
        state.counters,
        state.history,
        live,
        None if last_freed is None else state.handles[last_freed],
        tuple(frozen_stale),
    )


def _listed(operation: object) -> list[object]:
    """The items of ``operation``'s list-of-handles arguments, in list order."""
    declaration = declaration_of(operation)
    items: list[object] = []
    arguments = declaration.arguments(operation)
    for parameter, value in zip(declaration.parameters, arguments, strict=True):
        if parameter.kind is ArgKind.HANDLES and isinstance(value, tuple | AsTuple):
            items += value.refs if isinstance(value, AsTuple) else value
    return items


def _freed_last(
    before: model.PoolState,
    operation: object,
    after: model.PoolState,
    names: Sequence[Handle],
) -> model.HandleId | None:
    """The handle ``operation`` pushed onto a free list last; None if it freed none.

    A list is pushed in list order; anything else (``free_all``) in allocation order.
    """
    freed = [h for h in model.live_handles(before) if after.handles[h].owner is None]
    serial_of = {name: serial for serial, name in enumerate(names)}
    listed = [serial_of.get(item) for item in _listed(operation) if isinstance(item, Handle)]
    pushed = [serial for serial in listed if serial in freed]
    if pushed:
        return pushed[-1]
    return freed[-1] if freed else None


#: The spec's prediction for one call: the next state, and the result or ``Err``.
Prediction = tuple[model.PoolState, object]


@dataclass(frozen=True)
class _Node:
    """A distinct state, reached by a shortest path stored as a parent link."""

    state: model.PoolState
    names: tuple[Handle, ...]  # names[serial]: the name of the spec's handle ``serial``
    last_freed: model.HandleId | None
    depth: int  # calls on the path here; the next call is labelled with it
    parent: int  # index of the parent node; -1 for the initial state
    letter: str  # the letter taken from the parent
    operation: object | None  # that letter, made concrete at the parent
    prediction: Prediction | None  # what the spec predicted for that operation

    def picks(self) -> Names:
        """The names the letters pick from here."""
        live = [self.names[serial] for serial in model.live_handles(self.state)]
        freed_last = None if self.last_freed is None else self.names[self.last_freed]
        return Names(live=live, issued=self.names, freed_last=freed_last)


# ---- results -----------------------------------------------------------------------


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
            "new_states_per_depth": list(self.new_states_per_depth),
            "seconds": round(self.seconds, 3),
            "verdict": self.verdict.value,
            "not_checked": None if self.gap is None else self.gap.to_json(),
            "counterexample": None if found is None else found.to_json(),
        }


# ---- the search --------------------------------------------------------------------


class _ReplayLockstep(Lockstep):
    """A Lockstep that replays an already checked path cheaply.

    While ``checking`` is off only outcomes are compared, and predictions
    queued in ``script`` stand in for the spec's (``Lockstep._predict`` is the
    seam; this package owns both). ``last_prediction`` keeps the spec's latest.
    """

    def __init__(self, factory: AllocatorFactory | Port, scope: Scope) -> None:
        super().__init__(factory, scope.config, scope.history_len)
        self.checking = True
        self.script: list[Prediction] = []  # popped from the end
        self.last_prediction: Prediction | None = None

    def _predict(self, op: object) -> Prediction:
        if self.script:
            return self.script.pop()
        self.last_prediction = super()._predict(op)
        return self.last_prediction

    def compare_observations(self) -> None:
        """Compare everything, unless ``checking`` is off."""
        if self.checking:
            super().compare_observations()


class _Explorer:
    """Breadth-first search over one scope; each distinct state is one ``_Node``."""

    def __init__(
        self,
        scope: Scope,
        factory: AllocatorFactory | Port,
        *,
        max_states: int | None = None,
        deadline: float | None = None,
        on_failure: Callable[[Counterexample], None] | None = None,
    ) -> None:
        initial = model.new_pool(scope.config, scope.history_len)
        if isinstance(initial, model.Err):
            raise ValueError(f"scope {scope.name!r} is rejected by the spec: {initial}")
        self.scope = scope
        self.factory = factory
        # A port is explored through the calls it offers (a reference port: no sharing).
        offered = factory.offered if isinstance(factory, Port) else ALL_CALLS
        self.letters = tuple(
            letter for letter in alphabet(scope.config) if letter.declaration.name in offered
        )
        self.nodes = [_Node(initial, (), None, 0, -1, "", None, None)]
        self.seen = {canonical_key(initial, None)}
        self.transitions = 0
        self.merges_probed = 0
        self.new_states_per_depth: list[int] = []
        self.probe_failure: Counterexample | None = None  # the first merge probe that failed
        self.max_states = max_states
        self.deadline = deadline  # time.monotonic() after which the search stops
        self.gap: Gap | None = None  # set when a budget stopped the search
        #: Told every counterexample, when the search goes on after one (the report's mode):
        #: a failing transition is then not followed, and the search carries on.
        self.on_failure = on_failure

    def _out_of_budget(self, level: int, target: int, expanded: int, layer: int) -> bool:
        """Whether a budget ran out while checking length ``level``; if so, record the gap."""
        if self.max_states is not None and len(self.seen) >= self.max_states:
            why = f"the budget of {self.max_states:,} distinct states ran out"
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            why = "the time budget ran out"
        else:
            return False
        self.gap = Gap(
            f"sequences of length {level} to {target} (every sequence up to length "
            f"{level - 1} was checked, and those of length {level} from {expanded:,} of "
            f"the {layer:,} states reached at length {level - 1})",
            why,
        )
        return True

    def path(self, index: int) -> list[_Node]:
        """The nodes from the initial one (excluded) to node ``index``, in order."""
        path = []
        while index > 0:
            path.append(self.nodes[index])
            index = self.nodes[index].parent
        return path[::-1]

    def replay(self, index: int) -> _ReplayLockstep:
        """A fresh allocator and spec, advanced along the path to node ``index``."""
        path = self.path(index)
        lockstep = _ReplayLockstep(self.factory, self.scope)
        lockstep.script = [node.prediction for node in reversed(path) if node.prediction]
        lockstep.checking = False
        for node in path:
            assert node.operation is not None, "only the initial node has no operation"
            lockstep.apply(node.operation)
        lockstep.checking = True
        return lockstep

    def expand(self, index: int) -> list[int] | Counterexample:
        """Check every letter at node ``index``; return the new nodes, or a counterexample."""
        node = self.nodes[index]
        picks = node.picks()
        lockstep: _ReplayLockstep | None = None
        run: list[tuple[str, object]] = []  # applied to ``lockstep`` since its replay
        new: list[int] = []
        for letter in self.letters:
            operation = letter.build(picks)
            if operation is None:
                continue
            try:
                if lockstep is None:
                    lockstep, run = self.replay(index), []
                run.append((repr(letter), operation))
                lockstep.checking = False  # the outcome is still compared
                lockstep.apply(operation)
                self.transitions += 1
                if lockstep.state == node.state:
                    continue
                lockstep.checking = True
                lockstep.compare_observations()  # also covers the unchanged run before it
            except ConformanceError as error:
                found = self._counterexample(index, run, lockstep, error)
                if self.on_failure is None:
                    return found
                self.on_failure(found)
                lockstep = None
                continue
            child = self._add_child(index, repr(letter), operation, lockstep.last_prediction)
            if child is not None:
                new.append(child)
            elif self.probe_failure is None:
                self._probe(index, repr(letter), operation, lockstep)
                if self.on_failure is not None and self.probe_failure is not None:
                    self.on_failure(self.probe_failure)
                    self.probe_failure = None
            lockstep = None  # the next letter starts from this node's state again
        return new if lockstep is None else self._check_run(index, run, lockstep, new)

    def _check_run(
        self,
        index: int,
        run: list[tuple[str, object]],
        lockstep: _ReplayLockstep,
        new: list[int],
    ) -> list[int] | Counterexample:
        """Compare everything after a final run of letters that changed nothing."""
        try:
            lockstep.checking = True
            lockstep.compare_observations()
        except ConformanceError as error:
            found = self._counterexample(index, run, lockstep, error)
            if self.on_failure is None:
                return found
            self.on_failure(found)
        return new

    def _add_child(
        self, parent: int, letter: str, operation: object, prediction: Prediction | None
    ) -> int | None:
        """Record the state ``operation`` led to; None if its key was seen (a merge)."""
        assert prediction is not None, "the spec predicted the operation just applied"
        before, state = self.nodes[parent], prediction[0]
        last_freed = _freed_last(before.state, operation, state, before.names)
        last_freed = before.last_freed if last_freed is None else last_freed
        key = canonical_key(state, last_freed)
        if key in self.seen:
            return None
        self.seen.add(key)
        new = range(len(before.state.handles), len(state.handles))
        names = (*before.names, *(Handle(before.depth, i) for i in range(len(new))))
        depth = before.depth + 1
        self.nodes.append(
            _Node(state, names, last_freed, depth, parent, letter, operation, prediction)
        )
        return len(self.nodes) - 1

    def _probe(self, index: int, letter: str, operation: object, lockstep: _ReplayLockstep) -> None:
        """Run :func:`probe` on a path that is merged away; keep its failure, if any.

        Outcomes are compared call by call, everything else after the last call.
        """
        self.merges_probed += 1
        calls = probe(lockstep.state)
        for position, call in enumerate(calls):
            try:
                lockstep.checking = position == len(calls) - 1
                lockstep.apply(call)
            except ConformanceError as error:
                self.probe_failure = self._probe_counterexample(
                    index, letter, operation, calls[: position + 1], error
                )
                return

    def _probe_counterexample(
        self,
        index: int,
        letter: str,
        operation: object,
        calls: list[object],
        error: ConformanceError,
    ) -> Counterexample:
        """The merged path and the first probe call that fails alone, else all of them."""
        for call in calls if len(calls) > 1 else ():
            try:
                fresh = self.replay(index)
                fresh.apply(operation)
                fresh.apply(call)
            except ConformanceError as alone:
                calls, error = [call], alone
                break
        letters = [letter, *(PROBE_LETTER for _ in calls)]
        return self._after_path(index, letters, [operation, *calls], str(error), error)

    def _counterexample(
        self,
        index: int,
        run: list[tuple[str, object]],
        lockstep: Lockstep | None,
        error: ConformanceError,
    ) -> Counterexample:
        """The path and the first letter of ``run`` that fails alone, else all of ``run``."""
        if lockstep is None:  # the replay itself went another way: nondeterminism
            message = f"replaying the checked path to this state diverged:\n{error}"
            return self._after_path(index, [], [], message, error)
        for letter, operation in run if len(run) > 1 else ():
            try:
                self.replay(index).apply(operation)
            except ConformanceError as alone:
                run, error = [(letter, operation)], alone
                break
        letters, operations = [name for name, _ in run], [op for _, op in run]
        return self._after_path(index, letters, operations, str(error), error)

    def _after_path(
        self,
        index: int,
        letters: list[str],
        operations: list[object],
        message: str,
        error: ConformanceError | None = None,
    ) -> Counterexample:
        path = self.path(index)
        return Counterexample(
            (*(node.letter for node in path), *letters),
            (*(node.operation for node in path if node.operation is not None), *operations),
            message,
            self.scope,
            error,
        )

    def search(self, depth: int, progress: Callable[[str], None] | None) -> Counterexample | None:
        """Check depth by depth up to ``depth``; return a shortest counterexample, if any.

        A failure at depth d is returned at once. A merge probe's failure is
        d plus k calls long: it is returned once every depth up to its length
        minus one has passed, so nothing shorter was missed.
        """
        try:
            self.replay(0).compare_observations()
        except ConformanceError as error:
            return Counterexample((), (), str(error), self.scope, error)
        start, layer = time.perf_counter(), [0]
        for level in range(1, depth + 1):
            next_layer: list[int] = []
            for expanded, index in enumerate(layer):
                if self._out_of_budget(level, depth, expanded, len(layer)):
                    return self.probe_failure
                outcome = self.expand(index)
                if isinstance(outcome, Counterexample):
                    return outcome
                next_layer += outcome
            layer = next_layer
            self.new_states_per_depth.append(len(layer))
            if progress is not None:
                progress(
                    f"{self.scope.name}: depth {level}: {len(layer)} new states, "
                    f"{len(self.seen)} states, {self.transitions} transitions, "
                    f"{self.merges_probed} merges probed, {time.perf_counter() - start:.1f}s"
                )
            found = self.probe_failure
            if found is not None and len(found.operations) <= level + 1:
                return found
        return self.probe_failure


def explore(
    scope: Scope,
    depth: int,
    factory: AllocatorFactory | Port = default_factory,
    progress: Callable[[str], None] | None = None,
    *,
    max_states: int | None = None,
    deadline: float | None = None,
    on_failure: Callable[[Counterexample], None] | None = None,
) -> Exploration:
    """Check every sequence of up to ``depth`` letters on ``scope``'s pool, breadth first.

    Args:
        scope: The pool (config and ``history_len``).
        depth: The longest sequence; 0 checks the initial state only.
        factory: Builds the allocator under test.
        progress: Called with one line per depth.
        max_states: Stop once this many distinct states are known (``None``: never).
        deadline: Stop at this ``time.monotonic()`` (``None``: never).
        on_failure: Go on after a counterexample, telling it to this (each failing
            transition is then not followed); the one returned is then the initial
            state's, if that fails.

    Returns:
        The counts, the first (hence a shortest) counterexample if any, and
        the gap a budget left (then the verdict is inconclusive).
    """
    start = time.perf_counter()
    explorer = _Explorer(
        scope, factory, max_states=max_states, deadline=deadline, on_failure=on_failure
    )
    counterexample = explorer.search(depth, progress)
    return Exploration(
        scope=scope.name,
        depth=depth,
        states=len(explorer.seen),
        transitions=explorer.transitions,
        merges_probed=explorer.merges_probed,
        new_states_per_depth=tuple(explorer.new_states_per_depth),
        seconds=time.perf_counter() - start,
        counterexample=counterexample,
        gap=explorer.gap,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``veloxquant-mlx exhaustive`` (:mod:`~veloxquant_mlx.testing.exhaustive_command`)."""
    from veloxquant_mlx.testing.exhaustive_command import main as command_main  # noqa: PLC0415

    return command_main(argv)
