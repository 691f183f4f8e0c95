"""Small-scope exhaustive check: every operation sequence up to a depth, in lockstep.

Random testing (the Hypothesis conformance machine) samples long sequences;
this checker covers all short ones. On each small pool of :data:`SCOPES`
(both stream modes, growth with a cap, up to 4 blocks, owners 0 and 1) it
explores breadth first every sequence of up to ``depth`` letters of a finite
alphabet (:func:`alphabet`), driving the allocator under test through every
transition in :class:`~veloxquant_mlx.testing.lockstep.Lockstep`, which
compares all that a caller can observe with the spec. The alphabet is
*relative* ("free the 2nd live handle in checkout order", "free the handle
freed last"): a letter is made concrete against the spec's state at each
node (``Free((handle_id,))``), so a path replays exactly on a fresh pool.

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

Command line (:mod:`~veloxquant_mlx.testing.exhaustive_command`): ``python -m
veloxquant_mlx.testing.exhaustive [--profile ci|nightly] [--depth N]
[--scope NAME]... [--max-states N] [--time-budget SECONDS] [--json]``; exit
status 0 OK, 1 counterexample, 2 bad input, 3 inconclusive, 130 Ctrl-C.

Complexity: O(S x A x D) calls for S distinct states (about x8 per depth),
A letters (about 40) and depth D; memory O(S). Thread safety: none; each
:func:`explore` builds its own allocators, one per thread or process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from veloxquant_mlx.commandline.verdicts import Gap, Verdict, verdict_of
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.testing.lockstep import (
    AllocatorFactory,
    AllocatorUnderTest,
    ConformanceError,
    Lockstep,
)
from veloxquant_mlx.testing.operations import (
    Allocate,
    ForeignBlock,
    Free,
    FreeAll,
    MarkUsed,
    NotABlock,
    NotAList,
    Operation,
    RegisterOwner,
    ReleaseOwner,
    Shrink,
)
from veloxquant_mlx_spec import model

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


def default_factory(config: PoolConfig, history_len: int) -> AllocatorUnderTest:
    """Our own allocator, the default system under test."""
    return BlockPoolAllocator(config, history_len=history_len)


# ---- the alphabet ------------------------------------------------------------------

Handles = tuple[model.HandleId, ...]
#: Picks a letter's handles at a node (spec state, handle freed last); None: not applicable.
Pick = Callable[[model.PoolState, model.HandleId | None], Handles | None]


@dataclass(frozen=True)
class Letter:
    """One relative operation: a readable name, and how to make it concrete at a node."""

    name: str
    pick: Pick | None  # None: the operation names no handle
    build: Callable[[Handles], Operation]

    def resolve(
        self, state: model.PoolState, last_freed: model.HandleId | None
    ) -> Operation | None:
        """The concrete operation at this node, or None where the letter does not apply."""
        handles = () if self.pick is None else self.pick(state, last_freed)
        return None if handles is None else self.build(handles)


def _fixed(operation: Operation) -> Letter:
    return Letter(repr(operation), None, lambda _: operation)


def _live_at(*indexes: int, at_least: int = 1) -> Pick:
    """The live handles at ``indexes`` in checkout order (negative: from the newest)."""
    needed = max(at_least, *(i + 1 if i >= 0 else -i for i in indexes))

    def pick(state: model.PoolState, _last_freed: model.HandleId | None) -> Handles | None:
        live = model.live_handles(state)
        return tuple(live[i] for i in indexes) if len(live) >= needed else None

    return pick


def _freed_last_pick(_state: model.PoolState, last_freed: model.HandleId | None) -> Handles | None:
    return None if last_freed is None else (last_freed,)


def _mark(n_used: int) -> Callable[[Handles], Operation]:
    return lambda handles: MarkUsed(handles[0], n_used)


def _handle_letters(config: model.SpecConfig) -> list[Letter]:
    """Frees of live handles, fill levels, a double free, and the stale-handle calls."""
    max_live = max(config.n_blocks, config.max_blocks or 0)
    letters = [Letter(f"free(live[{i}])", _live_at(i), Free) for i in range(max_live)]
    letters += [
        Letter("free(live[-1], live[-2])", _live_at(-1, -2), Free),  # not in checkout order
        Letter("free(live[0], live[0])", _live_at(0, 0), Free),
        Letter("free(freed last)", _freed_last_pick, Free),
        Letter("mark_used(freed last, 1)", _freed_last_pick, _mark(1)),
    ]
    for n_used in sorted({1, config.block_size}):  # partial and full
        letters.append(Letter(f"mark_used(live[0], {n_used})", _live_at(0), _mark(n_used)))
        newest = _live_at(-1, at_least=2)  # with one live handle, live[0] says it all
        letters.append(Letter(f"mark_used(live[-1], {n_used})", newest, _mark(n_used)))
    too_full = config.block_size + 1
    letters.append(Letter(f"mark_used(live[0], {too_full})", _live_at(0), _mark(too_full)))
    return letters


def _fixed_operations(config: model.SpecConfig) -> list[Operation]:
    """Calls that name no handle: allocations, owners, shrinks, and bad arguments."""
    streams = ("k", "v") if config.separate_kv else ("k", "v", "kv")
    storage_streams = ("k", "v") if config.separate_kv else ("kv",)
    operations: list[Operation] = [
        Allocate(stream, n_tokens, owner, FORMAT_OF_OWNER[owner])
        for stream in streams
        for owner in OWNERS
        for n_tokens in (1, config.block_size + 1)
    ]
    operations += [FreeAll(owner) for owner in OWNERS]
    operations += [RegisterOwner(owner) for owner in OWNERS]
    operations += [ReleaseOwner(owner) for owner in OWNERS]
    operations += [Shrink(stream, n) for stream in storage_streams for n in (0, 1)]
    return [
        *operations,
        Free(()),  # a no-op
        MarkUsed(ForeignBlock(None), 1),  # built by hand: only that object's n_used changes
        # A few bad arguments; each must leave the pool as it was.
        Allocate("kv" if config.separate_kv else "x", 1, 0),
        Allocate("k", 0, 0),
        Allocate("k", 1, True),
        Free(NotAList()),
        Shrink("k", -1),
        MarkUsed(ForeignBlock(0), 1),  # another pool's live handle
        MarkUsed(NotABlock(), 1),
    ]


def alphabet(config: model.SpecConfig) -> tuple[Letter, ...]:
    """Every letter explored on a pool of ``config``: fixed calls, then handle calls."""
    return (*map(_fixed, _fixed_operations(config)), *_handle_letters(config))


def probe(state: model.PoolState) -> list[Operation]:
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
    operations: list[Operation] = [RegisterOwner(o) for o in OWNERS if o not in holding]
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


def _freed_last(
    before: model.PoolState, operation: Operation, after: model.PoolState
) -> model.HandleId | None:
    """The handle ``operation`` pushed onto a free list last; None if it freed none."""
    freed = [h for h in model.live_handles(before) if after.handles[h].owner is None]
    if freed and isinstance(operation, Free) and not isinstance(operation.blocks, NotAList):
        last = operation.blocks[-1]  # free() pushes in list order
        return last if model.is_int(last) else None
    return freed[-1] if freed else None  # free_all() pushes in allocation order


#: The spec's prediction for one call: the next state, and the result or ``Err``.
Prediction = tuple[model.PoolState, object]


@dataclass(frozen=True)
class _Node:
    """A distinct state, reached by a shortest path stored as a parent link."""

    state: model.PoolState
    last_freed: model.HandleId | None
    parent: int  # index of the parent node; -1 for the initial state
    letter: str  # the letter taken from the parent
    operation: Operation | None  # that letter, made concrete at the parent
    prediction: Prediction | None  # what the spec predicted for that operation


# ---- results -----------------------------------------------------------------------


@dataclass(frozen=True)
class Counterexample:
    """A sequence on which the allocator and the spec disagree (a shortest one)."""

    letters: tuple[str, ...]
    operations: tuple[Operation, ...]  # replays with a fresh Lockstep
    message: str  # the ConformanceError's

    def __str__(self) -> str:
        steps = [
            f"\n  {i}: {op!r}" + ("" if letter == repr(op) else f"  # {letter}")
            for i, (letter, op) in enumerate(zip(self.letters, self.operations, strict=True))
        ]
        return f"{len(self.operations)} operations:{''.join(steps)}\n{self.message}"

    def to_json(self) -> dict[str, object]:
        """JSON-ready values; operations as their reprs."""
        operations = [repr(op) for op in self.operations]
        return {"letters": list(self.letters), "operations": operations, "message": self.message}


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

    def __init__(self, factory: AllocatorFactory, scope: Scope) -> None:
        super().__init__(factory, scope.config, scope.history_len)
        self.checking = True
        self.script: list[Prediction] = []  # popped from the end
        self.last_prediction: Prediction | None = None

    def _predict(self, op: Operation) -> Prediction:
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
        factory: AllocatorFactory,
        *,
        max_states: int | None = None,
        deadline: float | None = None,
    ) -> None:
        initial = model.new_pool(scope.config, scope.history_len)
        if isinstance(initial, model.Err):
            raise ValueError(f"scope {scope.name!r} is rejected by the spec: {initial}")
        self.scope = scope
        self.factory = factory
        self.letters = alphabet(scope.config)
        self.nodes = [_Node(initial, None, -1, "", None, None)]
        self.seen = {canonical_key(initial, None)}
        self.transitions = 0
        self.merges_probed = 0
        self.new_states_per_depth: list[int] = []
        self.probe_failure: Counterexample | None = None  # the first merge probe that failed
        self.max_states = max_states
        self.deadline = deadline  # time.monotonic() after which the search stops
        self.gap: Gap | None = None  # set when a budget stopped the search

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
        lockstep: _ReplayLockstep | None = None
        run: list[tuple[str, Operation]] = []  # applied to ``lockstep`` since its replay
        new: list[int] = []
        for letter in self.letters:
            operation = letter.resolve(node.state, node.last_freed)
            if operation is None:
                continue
            try:
                if lockstep is None:
                    lockstep, run = self.replay(index), []
                run.append((letter.name, operation))
                lockstep.checking = False  # the outcome is still compared
                lockstep.apply(operation)
                self.transitions += 1
                if lockstep.state == node.state:
                    continue
                lockstep.checking = True
                lockstep.compare_observations()  # also covers the unchanged run before it
            except ConformanceError as error:
                return self._counterexample(index, run, lockstep, error)
            child = self._add_child(index, letter.name, operation, lockstep.last_prediction)
            if child is not None:
                new.append(child)
            elif self.probe_failure is None:
                self._probe(index, letter.name, operation, lockstep)
            lockstep = None  # the next letter starts from this node's state again
        return new if lockstep is None else self._check_run(index, run, lockstep, new)

    def _check_run(
        self,
        index: int,
        run: list[tuple[str, Operation]],
        lockstep: _ReplayLockstep,
        new: list[int],
    ) -> list[int] | Counterexample:
        """Compare everything after a final run of letters that changed nothing."""
        try:
            lockstep.checking = True
            lockstep.compare_observations()
        except ConformanceError as error:
            return self._counterexample(index, run, lockstep, error)
        return new

    def _add_child(
        self, parent: int, letter: str, operation: Operation, prediction: Prediction | None
    ) -> int | None:
        """Record the state ``operation`` led to; None if its key was seen (a merge)."""
        assert prediction is not None, "the spec predicted the operation just applied"
        before, state = self.nodes[parent], prediction[0]
        last_freed = _freed_last(before.state, operation, state)
        last_freed = before.last_freed if last_freed is None else last_freed
        key = canonical_key(state, last_freed)
        if key in self.seen:
            return None
        self.seen.add(key)
        self.nodes.append(_Node(state, last_freed, parent, letter, operation, prediction))
        return len(self.nodes) - 1

    def _probe(
        self, index: int, letter: str, operation: Operation, lockstep: _ReplayLockstep
    ) -> None:
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
                    index, letter, operation, calls[: position + 1], str(error)
                )
                return

    def _probe_counterexample(
        self, index: int, letter: str, operation: Operation, calls: list[Operation], message: str
    ) -> Counterexample:
        """The merged path and the first probe call that fails alone, else all of them."""
        for call in calls if len(calls) > 1 else ():
            try:
                fresh = self.replay(index)
                fresh.apply(operation)
                fresh.apply(call)
            except ConformanceError as alone:
                calls, message = [call], str(alone)
                break
        letters = [letter, *(PROBE_LETTER for _ in calls)]
        return self._after_path(index, letters, [operation, *calls], message)

    def _counterexample(
        self,
        index: int,
        run: list[tuple[str, Operation]],
        lockstep: Lockstep | None,
        error: ConformanceError,
    ) -> Counterexample:
        """The path and the first letter of ``run`` that fails alone, else all of ``run``."""
        if lockstep is None:  # the replay itself went another way: nondeterminism
            message = f"replaying the checked path to this state diverged:\n{error}"
            return self._after_path(index, [], [], message)
        message = str(error)
        for letter, operation in run if len(run) > 1 else ():
            try:
                self.replay(index).apply(operation)
            except ConformanceError as alone:
                run, message = [(letter, operation)], str(alone)
                break
        letters, operations = [name for name, _ in run], [op for _, op in run]
        return self._after_path(index, letters, operations, message)

    def _after_path(
        self, index: int, letters: list[str], operations: list[Operation], message: str
    ) -> Counterexample:
        path = self.path(index)
        return Counterexample(
            (*(node.letter for node in path), *letters),
            (*(node.operation for node in path if node.operation is not None), *operations),
            message,
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
            return Counterexample((), (), str(error))
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
    factory: AllocatorFactory = default_factory,
    progress: Callable[[str], None] | None = None,
    *,
    max_states: int | None = None,
    deadline: float | None = None,
) -> Exploration:
    """Check every sequence of up to ``depth`` letters on ``scope``'s pool, breadth first.

    Args:
        scope: The pool (config and ``history_len``).
        depth: The longest sequence; 0 checks the initial state only.
        factory: Builds the allocator under test.
        progress: Called with one line per depth.
        max_states: Stop once this many distinct states are known (``None``: never).
        deadline: Stop at this ``time.monotonic()`` (``None``: never).

    Returns:
        The counts, the first (hence a shortest) counterexample if any, and
        the gap a budget left (then the verdict is inconclusive).
    """
    start = time.perf_counter()
    explorer = _Explorer(scope, factory, max_states=max_states, deadline=deadline)
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
    """The command line; see :mod:`veloxquant_mlx.testing.exhaustive_command`."""
    from veloxquant_mlx.testing.exhaustive_command import main as command_main  # noqa: PLC0415

    return command_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
