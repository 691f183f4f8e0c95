"""Small-scope exhaustive check: every operation sequence up to a depth, in lockstep.

Random testing (the Hypothesis conformance machine) samples long sequences;
this checker covers all short ones. On each small pool of :data:`SCOPES`
(both stream modes, growth with a cap, up to 4 blocks, owners 0 and 1) it
explores breadth first every sequence of up to ``depth`` letters of a finite
alphabet (:func:`alphabet`), driving the allocator under test through every
transition in :class:`~veloxquant_mlx.testing.lockstep.Lockstep`, which
compares all that a caller can observe with the spec. The alphabet is
derived from the operation table (:func:`~veloxquant_mlx.testing.templates.small_scope`:
every call with its small-scope arguments, every handle shape, junk after a
live handle in a list, every bad value of every argument, wrong types
included; see :mod:`~veloxquant_mlx.testing.exhaustive_scope`) and is
*relative* ("free the 2nd live handle in checkout order", "free the handle
freed last"): a letter is made concrete
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

**No-op probe.** A letter the spec treats as a no-op (``release_owner`` of an
owner holding nothing, ``free([])``, a ``shrink`` that retires nothing, a
refused call) leads back to its own state, so it is never followed; an
allocator may still have changed something it does not show (a registration
left behind by ``release_owner(0)``, seen only when ``register_owner(0)`` is
refused). So the no-op letters of a state run together and are then probed,
and each no-op the spec *accepts* is also run and probed alone (a later no-op
of the run, ``free_all(0)``, could undo what it changed). A probe failure is
put on the state itself if a probe call fails there alone, else on the one
no-op letter it follows. This probes every state reached, once.

**Shortest.** The search goes depth by depth: a failure at depth d is
reported at once, a probe's failure (the merged path and the probe call that
fails alone) once every shorter sequence has passed.

**Cost.** The spec sorts a state's letters first (its prediction is kept
for the run). Letters that leave the spec state unchanged run one after
another on one replay of the node's path: each outcome is compared at once,
everything else when the run ends, and a failure is re-run letter by letter
on fresh replays to name a shortest sequence. Every other letter, and each
accepted no-op's probe, gets a fresh replay, which reuses the spec's recorded
predictions and skips the full comparison that path already passed. On the
CI profile that is about twice the calls of an alphabet of first bad values
without no-op probes (tests print the counts as "exhaustive check coverage").

**Budget.** A search may be given a budget of distinct states (memory) and a
deadline (time). When one runs out the search stops where it is and the
:class:`Exploration` says how far it got (every sequence up to the last
finished depth) as a :class:`~veloxquant_mlx.commandline.verdicts.Gap`: its
verdict is then inconclusive, not OK.

**Progress.** ``progress`` gets a line per depth and, while a depth runs,
one at most every :data:`~veloxquant_mlx.commandline.progress.PROGRESS_INTERVAL_S` of wall
time (:class:`~veloxquant_mlx.commandline.progress.ProgressThrottle`, which
the schedule explorers share): an operator in CI sees that
a long depth is alive.

Command line (:mod:`~veloxquant_mlx.testing.exhaustive_command`):
``veloxquant-mlx exhaustive [--profile ci|nightly] [--depth N] [--scope
NAME]... [--max-states N] [--time-budget SECONDS] [--factory MODULE:CALLABLE
| --driver COMMAND] [--json] [--out DIR]``;
exit status 0 OK, 1 counterexample, 2 bad input, 3 inconclusive, 130 Ctrl-C.

Complexity: O(S x A x D) calls for S distinct states (about x8 per depth),
A letters (about 100) and depth D; memory O(S). Thread safety: none; each
:func:`explore` builds its own allocators, one per thread or process.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below load is one line too
    from veloxquant_mlx.commandline.sigint import run_program

    run_program(
        "python -m veloxquant_mlx.testing.exhaustive", "veloxquant_mlx.testing.exhaustive_command"
    )

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from veloxquant_mlx.commandline.progress import ProgressThrottle
from veloxquant_mlx.commandline.verdicts import Gap
from veloxquant_mlx.testing.driven import DriverFailure
from veloxquant_mlx.testing.exhaustive_results import Counterexample, Exploration
from veloxquant_mlx.testing.exhaustive_scope import (
    FORMAT_OF_OWNER,
    OWNERS,
    PROFILE_DEPTHS,
    SCOPES,
    Scope,
    alphabet,
    canonical_key,
    default_factory,
    freed_last,
    port_scope,
    probe,
)
from veloxquant_mlx.testing.lockstep import AllocatorFactory, ConformanceError, Lockstep
from veloxquant_mlx.testing.port import ALL_CALLS, Port
from veloxquant_mlx.testing.sides import SpecSide
from veloxquant_mlx.testing.templates import Names
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.table import Handle

__all__ = [
    "FORMAT_OF_OWNER",
    "OWNERS",
    "PROBE_LETTER",
    "PROFILE_DEPTHS",
    "SCOPES",
    "Counterexample",
    "Exploration",
    "Scope",
    "alphabet",
    "canonical_key",
    "default_factory",
    "explore",
    "port_scope",
    "probe",
]

#: The letter shown for a call of :func:`probe` in a counterexample.
PROBE_LETTER = "(probe)"

#: The spec's prediction for one call: the next state, and the result or ``Err``.
Prediction = tuple[model.PoolState, object]
#: One call of a run: the letter's name (``PROBE_LETTER`` for a probe call) and the operation.
Step = tuple[str, object]


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

    def spec_side(self) -> SpecSide:
        """The spec in this state, with its names: predicts a letter without a replay."""
        side = SpecSide(self.state)
        side.names = list(self.names)
        side.serial_of = {name: serial for serial, name in enumerate(self.names)}
        return side

    def picks(self) -> Names:
        """The names the letters pick from here."""
        live = [self.names[serial] for serial in model.live_handles(self.state)]
        freed_last = None if self.last_freed is None else self.names[self.last_freed]
        return Names(live=live, issued=self.names, freed_last=freed_last)


@dataclass(frozen=True)
class _Letter:
    """A letter made concrete at a node, with the spec's prediction for it there."""

    name: str  # the template, as a report shows it
    operation: object
    prediction: Prediction

    @property
    def step(self) -> Step:
        """The letter as one step of a run: its name and its operation."""
        return self.name, self.operation


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
        # A bare factory offers every call; made a Port once, not once per replay.
        self.factory = (
            factory if isinstance(factory, Port) else Port(factory, capabilities=ALL_CALLS)
        )
        # A port is explored through the calls it offers (a reference port: no sharing).
        offered = self.factory.offered
        self.letters = tuple(
            letter for letter in alphabet(scope.config) if letter.declaration.name in offered
        )
        self.nodes = [_Node(initial, (), None, 0, -1, "", None, None)]
        self.seen = {canonical_key(initial, None)}
        self.transitions = 0
        self.merges_probed = 0
        self.no_op_runs_probed = 0  # states whose no-op letters were run and then probed
        self.new_states_per_depth: list[int] = []
        self.probe_failure: Counterexample | None = None  # the first merge probe that failed
        self.max_states = max_states
        self.deadline = deadline  # time.monotonic() after which the search stops
        self.gap: Gap | None = None  # set when a budget stopped the search
        #: Told every counterexample, when the search goes on after one (the report's mode):
        #: a failing transition is then not followed, and the search carries on.
        self.on_failure = on_failure
        #: What ``expand`` runs after the path, for a driver failure's note: the no-op
        #: letters run so far on one replay (``trying_run``), then ``trying``.
        self.trying = ""
        self.trying_run: list[Step] | None = None

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
        """Check every letter at node ``index``; return the new nodes, or a counterexample.

        The spec sorts the letters first: each one that changes the state runs on a
        fresh replay of the path; those it treats as no-ops run together on one, and
        are then probed (:meth:`_check_no_ops`).

        Raises:
            DriverFailure: A driven port's driver broke the protocol (died, wrote junk,
                answered late); a note on it names the path and the letters being run.
        """
        self.trying, self.trying_run = "", None
        try:
            return self._expand(index)
        except DriverFailure as failure:
            failure.add_note(f"the failing run on a new pool: {self._failing_run(index)}")
            raise

    def _failing_run(self, index: int) -> str:
        """The calls the crashed pool was given: the path, then what ``expand`` ran."""
        path = ", then ".join(node.letter for node in self.path(index))
        after = self.trying
        if self.trying_run:
            no_ops = "the no-ops " + ", ".join(name for name, _ in self.trying_run)
            after = f"{no_ops}, then {after}" if after else no_ops
        return ", then ".join(part for part in (path, after) if part)

    def _expand(self, index: int) -> list[int] | Counterexample:
        node = self.nodes[index]
        picks, spec = node.picks(), node.spec_side()
        no_ops: list[_Letter] = []
        new: list[int] = []
        for template in self.letters:
            operation = template.build(picks)
            if operation is None:
                continue
            prediction = spec.predict(operation)
            letter = _Letter(repr(template), operation, prediction)
            if prediction[0] is node.state or prediction[0] == node.state:
                no_ops.append(letter)
                continue
            self.trying, self.trying_run = letter.name, None
            outcome = self._follow(index, letter)
            if isinstance(outcome, Counterexample):
                return outcome
            if outcome is not None:
                new.append(outcome)
        found = self._check_no_ops(index, no_ops)
        if found is not None:
            return found
        # A call the spec accepts as a no-op is probed alone too: a later no-op of the
        # run could undo what it changed unseen (free_all(0) clears the registration that
        # a release_owner(0) left behind).
        for letter in no_ops:
            if not isinstance(letter.prediction[1], model.Err):
                self.trying, self.trying_run = f"{letter.name}, then the probes", None
                found = self._probe_accepted_no_op(index, letter)
                if found is not None:
                    return found
        return new

    def _follow(self, index: int, letter: _Letter) -> int | Counterexample | None:
        """Run one letter that changes the state; the new node, a counterexample, or None
        (a merge, or a failure told to ``on_failure``)."""
        lockstep: _ReplayLockstep | None = None
        try:
            lockstep = self.replay(index)
            lockstep.script.append(letter.prediction)
            lockstep.apply(letter.operation)
            self.transitions += 1
        except ConformanceError as error:
            return self._told(self._counterexample(index, [letter.step], lockstep, error))
        child = self._add_child(index, letter)
        if child is None and self.probe_failure is None:
            self._probe(index, letter.step, lockstep)
        return child

    def _told(self, found: Counterexample) -> Counterexample | None:
        """``found``, or None once it is told to ``on_failure`` (the search goes on)."""
        if self.on_failure is None:
            return found
        self.on_failure(found)
        return None

    def _check_no_ops(self, index: int, no_ops: list[_Letter]) -> Counterexample | None:
        """Run the letters the spec treats as no-ops one after another, then probe.

        Each outcome is compared at once, everything else after the last; then
        :func:`probe` looks for what they may have changed unseen (a registration,
        a free-list order). After a failure told to ``on_failure``, the letters
        left go on from a fresh replay.
        """
        pending = list(no_ops)
        while pending:
            lockstep: _ReplayLockstep | None = None
            run: list[Step] = []
            self.trying, self.trying_run = "", run  # run grows letter by letter
            try:
                lockstep = self.replay(index)
                lockstep.checking = False  # outcomes are still compared
                for letter in pending:
                    run.append(letter.step)
                    lockstep.script.append(letter.prediction)
                    lockstep.apply(letter.operation)
                    self.transitions += 1
                lockstep.checking = True
                lockstep.compare_observations()
            except ConformanceError as error:
                found = self._counterexample(index, run, lockstep, error)
                if self._told(found) is not None:
                    return found
                pending = pending[len(run) :]
                continue
            if self.probe_failure is None:
                self.trying = "the probes"
                self._probe_no_ops(index, run, lockstep)
            return None
        return None

    def _add_child(self, parent: int, letter: _Letter) -> int | None:
        """Record the state ``letter`` led to; None if its key was seen (a merge)."""
        before, state = self.nodes[parent], letter.prediction[0]
        last_freed = freed_last(before.state, letter.operation, state, before.names)
        last_freed = before.last_freed if last_freed is None else last_freed
        key = canonical_key(state, last_freed)
        if key in self.seen:
            return None
        self.seen.add(key)
        new = range(len(before.state.handles), len(state.handles))
        names = (*before.names, *(Handle(before.depth, i) for i in range(len(new))))
        depth = before.depth + 1
        self.nodes.append(
            _Node(state, names, last_freed, depth, parent, *letter.step, letter.prediction)
        )
        return len(self.nodes) - 1

    def _probe(self, index: int, step: Step, lockstep: _ReplayLockstep) -> None:
        """Run :func:`probe` on a path that is merged away; keep its failure, if any."""
        self.merges_probed += 1
        failed = _first_probe_failure(lockstep)
        if failed is not None:
            self._keep_probe_failure(self._probe_counterexample(index, step, *failed))

    def _keep_probe_failure(self, found: Counterexample) -> None:
        """Keep the first probe failure; in the report's mode, tell it and go on without it."""
        if self.on_failure is None:
            self.probe_failure = found
        else:
            self.on_failure(found)

    def _probe_accepted_no_op(self, index: int, letter: _Letter) -> Counterexample | None:
        """Replay, run ``letter`` (its outcome compared) and :func:`probe` after it."""
        if self.probe_failure is not None and self.on_failure is None:
            return None  # a probe already failed; a shorter one cannot come from here
        lockstep: _ReplayLockstep | None = None
        try:
            lockstep = self.replay(index)
            lockstep.checking = False  # the run compared the rest; the probe compares it again
            lockstep.script.append(letter.prediction)
            lockstep.apply(letter.operation)
        except ConformanceError as error:
            return self._told(self._counterexample(index, [letter.step], lockstep, error))
        self._probe_no_ops(index, [letter.step], lockstep)
        return None

    def _probe_no_ops(self, index: int, run: list[Step], lockstep: _ReplayLockstep) -> None:
        """Run :func:`probe` after the no-op letters ``run``; keep its failure, if any.

        The spec state is the node's, so the probe is the node's too. A failure is
        put on the node itself if a probe call fails there alone, else on the first
        no-op letter that a probe call fails after alone, else on the whole run.
        """
        self.no_op_runs_probed += 1
        failed = _first_probe_failure(lockstep)
        if failed is not None:
            self._keep_probe_failure(self._no_op_culprit(index, run, *failed))

    def _no_op_culprit(
        self, index: int, run: list[Step], calls: list[object], error: ConformanceError
    ) -> Counterexample:
        """The shortest of: a probe call alone, one no-op letter and a probe call, all."""
        probes = [(PROBE_LETTER, call) for call in calls]
        tries = ([*prefix, probe] for prefix in ([], *([step] for step in run)) for probe in probes)
        steps, error = self._first_alone(index, tries) or ([*run, *probes], error)
        return self._after_path(index, steps, error)

    def _probe_counterexample(
        self, index: int, step: Step, calls: list[object], error: ConformanceError
    ) -> Counterexample:
        """The merged path and the first probe call that fails alone, else all of them."""
        probes = [(PROBE_LETTER, call) for call in calls]
        tries = ([step, probe] for probe in probes) if len(probes) > 1 else ()
        steps, error = self._first_alone(index, tries) or ([step, *probes], error)
        return self._after_path(index, steps, error)

    def _counterexample(
        self, index: int, run: list[Step], lockstep: Lockstep | None, error: ConformanceError
    ) -> Counterexample:
        """The path and the first letter of ``run`` that fails alone, else all of ``run``."""
        if lockstep is None:  # the replay itself went another way: nondeterminism
            message = f"replaying the checked path to this state diverged:\n{error}"
            return self._after_path(index, [], error, message)
        tries = ([step] for step in run) if len(run) > 1 else ()
        steps, error = self._first_alone(index, tries) or (run, error)
        return self._after_path(index, steps, error)

    def _first_alone(
        self, index: int, tries: Iterable[list[Step]]
    ) -> tuple[list[Step], ConformanceError] | None:
        """The first of ``tries`` that fails on a fresh replay to node ``index``, and its error."""
        for steps in tries:
            try:
                fresh = self.replay(index)
                for _, operation in steps:
                    fresh.apply(operation)
            except ConformanceError as alone:
                return steps, alone
        return None

    def _after_path(
        self, index: int, steps: list[Step], error: ConformanceError, message: str | None = None
    ) -> Counterexample:
        """The path to node ``index``, then ``steps``; ``message`` defaults to the error's."""
        path = self.path(index)
        return Counterexample(
            (*(node.letter for node in path), *(name for name, _ in steps)),
            (
                *(node.operation for node in path if node.operation is not None),
                *(op for _, op in steps),
            ),
            str(error) if message is None else message,
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
        throttle, layer = ProgressThrottle(), [0]
        for level in range(1, depth + 1):
            next_layer: list[int] = []
            for expanded, index in enumerate(layer):
                if self._out_of_budget(level, depth, expanded, len(layer)):
                    return self.probe_failure
                outcome = self.expand(index)
                if isinstance(outcome, Counterexample):
                    return outcome
                next_layer += outcome
                if progress is not None and throttle.due():
                    progress(self._within_depth_line(level, expanded + 1, len(layer), throttle))
            layer = next_layer
            self.new_states_per_depth.append(len(layer))
            if progress is not None:
                progress(
                    f"{self.scope.name}: depth {level}: {len(layer)} new states, "
                    f"{len(self.seen)} states, {self.transitions} transitions, "
                    f"{self.merges_probed} merges probed, "
                    f"{self.no_op_runs_probed} no-op runs probed, "
                    f"{throttle.seconds():.1f}s"
                )
                throttle.printed()
            found = self.probe_failure
            if found is not None and len(found.operations) <= level + 1:
                return found
        return self.probe_failure

    def _within_depth_line(
        self, level: int, expanded: int, layer: int, throttle: ProgressThrottle
    ) -> str:
        """The progress line of a depth still running: ``expanded`` of its ``layer`` states."""
        return (
            f"  {self.scope.name}: depth {level}: {expanded:,} of {layer:,} states expanded, "
            f"{len(self.seen):,} states, {throttle.seconds():.0f} s"
        )


def _first_probe_failure(lockstep: _ReplayLockstep) -> tuple[list[object], ConformanceError] | None:
    """Run :func:`probe` on ``lockstep``: the calls up to the first that fails, and its error.

    Outcomes are compared call by call, everything else after the last call.
    """
    calls = probe(lockstep.state)
    for position, call in enumerate(calls):
        try:
            lockstep.checking = position == len(calls) - 1
            lockstep.apply(call)
        except ConformanceError as error:
            return calls[: position + 1], error
    return None


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
        progress: Called with one line per depth and, while a depth runs, one at
            most every ``PROGRESS_INTERVAL_S`` seconds (commandline.progress).
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
        no_op_runs_probed=explorer.no_op_runs_probed,
        new_states_per_depth=tuple(explorer.new_states_per_depth),
        seconds=time.perf_counter() - start,
        counterexample=counterexample,
        gap=explorer.gap,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``veloxquant-mlx exhaustive`` (:mod:`~veloxquant_mlx.testing.exhaustive_command`)."""
    from veloxquant_mlx.testing.exhaustive_command import main as command_main  # noqa: PLC0415

    return command_main(argv)
