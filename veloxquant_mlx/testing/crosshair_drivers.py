"""Bounded replay drivers: entry points for CrossHair's PEP 316 contract checking.

CrossHair cannot build a consistent ``PoolState`` from nothing (the spec
transitions' ``pre: all_invariants_hold(state)`` is "unable to meet
precondition"), so every driver here starts from ``new_pool`` on one of the
tiny :data:`CONFIGS` and takes only small, bounded integers. The bounds in
the ``pre:`` lines are what make symbolic execution effective: CrossHair
chooses the integers, and each choice is one short, concrete run (a few
tenths of a second under CrossHair: dozens of paths in CI's budget, thousands
in the nightly one).

- :func:`replay_agrees_with_spec` decodes each integer into a call of
  :data:`ALPHABET` (derived from the operation table: every call with its
  small-scope arguments one at a time, stale and foreign handles, junk, bad
  arguments; see :mod:`~veloxquant_mlx.testing.templates`) and runs them
  through :class:`~veloxquant_mlx.testing.lockstep.Lockstep`, which compares
  ``BlockPoolAllocator`` with the spec after every step.
- :func:`allocate_agrees_with_spec` feeds a symbolic ``n_tokens`` and
  ``owner`` straight into a lockstep ``allocate``.
- The ``spec_*`` drivers check properties of the spec alone: replays keep
  every invariant and what each transition promises, ``free_all`` undoes
  ``allocate``, an allocation is ``ceil(n_tokens / block_size)`` blocks
  holding ``n_tokens``, exhaustion changes nothing but ``n_exhausted`` and
  history, and growth re-issues the lowest retired ids first.

Every driver returns ``False`` on a violation instead of raising, and says
nothing about it: with crosshair-tool 0.0.113, a path that ends in an
exception whose message was built by an f-string is usually dropped, not
reported (CrossHair stubs ``repr`` at random and the message contradicts the
stub), so a raised ``ConformanceError`` would hide the bug it found. The
drivers also re-check what the spec's own ``post:`` lines say, because
CrossHair drops, rather than reports, a path on which a *called* function's
postcondition fails.

Run them (with the ``dev`` extra installed, from the repository root)::

    PYTHONPATH=.:spec crosshair check --analysis_kind=PEP316 \\
        --per_condition_timeout=20 veloxquant_mlx.testing.crosshair_drivers

or all of the project's targets within CI's time budget via
``.ci/crosshair`` (``.ci/crosshair --nightly`` for long timeouts). While
editing, ``crosshair watch --analysis_kind=PEP316 <this file>`` re-checks on
every save. CrossHair reports a violation as ``false when calling
replay_agrees_with_spec([1, 8], 3)``; :func:`replay` runs those arguments
concretely and raises the ``ConformanceError`` that says what differed.

Complexity: O(len(codes) * handles issued) per call. Thread safety: each
call builds its own pool and spec state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Final

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.testing.lockstep import ALL_CALLS, ConformanceError, Lockstep
from veloxquant_mlx.testing.sides import SpecSide, plans_uncached
from veloxquant_mlx.testing.templates import Issued, Names, Pick, Template, small_scope
from veloxquant_mlx_spec import invariants, model, transitions
from veloxquant_mlx_spec.model import ForeignBlock
from veloxquant_mlx_spec.operations import Allocate, BlockPool, FreeAll
from veloxquant_mlx_spec.table import AsTuple, Handle, Raised, declaration_of

#: Tiny pools: both stream modes, growth off, capped and uncapped, and a pool
#: that starts empty. Block size 2, so a block can be part full.
CONFIGS: Final = (
    model.SpecConfig(block_size=2, n_blocks=4, separate_kv=True),
    model.SpecConfig(block_size=2, n_blocks=3, separate_kv=False),
    model.SpecConfig(
        block_size=2, n_blocks=3, separate_kv=True, grow_on_exhaustion=True, max_blocks=5
    ),
    model.SpecConfig(block_size=2, n_blocks=0, separate_kv=False, grow_on_exhaustion=True),
)

#: Short enough that a four-step replay overflows it.
HISTORY_LEN: Final = 2

#: The calls a code decodes to, derived from the table for a shared pool (so "kv" is a
#: good stream there and a bad one in the separate pools). Every letter costs CrossHair
#: search time, so the alphabet is lean (about as many letters as a hand-picked one):
#: every call that changes the pool (queries are compared after every step anyway) with
#: its first values, the calls that hand out handles also with each value varied alone;
#: every handle pick; one bad value per call; valid calls first. Handles are picked by the
#: order they were issued (the first, the newest); a pick of one not issued yet decodes to
#: a block built by hand.
#: Sharing (share, fork, make_writable) would add half again as many letters as every
#: other call together, and CrossHair's budget is fixed; these reach each of its rules
#: (a share, a fork, a copy-on-write and its no-op, a repeated block, bad arguments).
SHARING_LETTERS: Final = frozenset(
    {
        "share([issued[0]], 1)",
        "fork(0, 1)",
        "make_writable(newest)",
        "make_writable(issued[0])",
        "share([newest, newest], 0)",
        "share(NotAList(), 0)",
        "fork(True, 0)",
    }
)


def _is_sharing(template: Template) -> bool:
    return template.declaration.name in {"share", "fork", "make_writable"}


_SCOPE: Final = small_scope(
    CONFIGS[1],
    handle_names=(Issued(-1), Issued(0)),
    list_names=(
        (Issued(0),),
        (Issued(-1),),
        AsTuple((Issued(-1),)),  # type: ignore[arg-type]  # picks, named by build()
        (Issued(0), Issued(-1)),
    ),
    combine=False,
    queries=False,
    stale=None,
    every_bad_argument=False,
    vary_values=lambda declaration: declaration.may_issue_handles,
)
_BEFORE_SHARING: Final = tuple(template for template in _SCOPE if not _is_sharing(template))
#: Sharing's letters come last: codes below :data:`N_BEFORE_SHARING` are the calls that
#: existed before sharing, which ``replay_agrees_with_spec`` searches as it always has;
#: ``sharing_replay_agrees_with_spec`` searches sequences with a sharing letter in them.
ALPHABET: Final[tuple[Template, ...]] = (
    *_BEFORE_SHARING,
    *(template for template in _SCOPE if repr(template) in SHARING_LETTERS),
)
N_BEFORE_SHARING: Final = len(_BEFORE_SHARING)

#: The calls the drivers make and observe: all but sharing's counters. Observed after every
#: step they cost CrossHair a fifth of its budget, and a wrong count shows in what stays
#: observed (free counts, blocks in use, the handles, the pool's check_invariants).
CALLS: Final = ALL_CALLS - {"shared_blocks", "n_shares", "n_copy_on_write"}
#: What ``replay_agrees_with_spec`` offers: the calls that existed before sharing.
CALLS_BEFORE_SHARING: Final = CALLS - {"share", "fork", "make_writable", "ref_count", "is_shared"}

#: Stream arguments for the drivers that take a ``stream_code``.
STREAMS: Final = ("k", "v", "kv")

#: The ``call`` of the placeholder names :func:`decode` gives the issued handles.
PLACEHOLDER_CALL: Final = -2


def _allocator(config: PoolConfig, history_len: int) -> BlockPool[Any]:
    return BlockPoolAllocator(config, history_len=history_len)


def resolve_reference(ref: Pick, n_issued: int) -> Pick:
    """Bind an issued-handle pick to one of ``n_issued`` handles; none: a block built by hand.

    post: not isinstance(__return__, Issued) or 0 <= __return__.index < n_issued
    """
    if not isinstance(ref, Issued):
        return ref
    index = ref.index + n_issued if ref.index < 0 else ref.index
    return Issued(index) if 0 <= index < n_issued else ForeignBlock(owner=None)


class _Placeholders(Sequence[Handle]):
    """``n`` names standing for the first ``n`` handles issued (no list: CrossHair stays fast)."""

    def __init__(self, n: int) -> None:
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> Handle:  # type: ignore[override]
        return Handle(PLACEHOLDER_CALL, index % self._n)

    def __iter__(self) -> Iterator[Handle]:
        return (Handle(PLACEHOLDER_CALL, i) for i in range(self._n))


def _concrete(
    code: int, issued: Sequence[Handle], letters: tuple[Template, ...] = ALPHABET
) -> object:
    """The call ``code`` stands for, with ``issued`` the names of the handles issued so far."""
    bound = letters[code].map_picks(lambda pick: resolve_reference(pick, len(issued)))
    op = bound.build(Names(live=(), issued=issued, freed_last=None))
    assert op is not None, "every pick is bound to an issued handle or to none"
    return op


def decode(code: int, n_issued: int) -> object:
    """The call ``code`` stands for, once ``n_issued`` handles exist (placeholder names).

    pre: 0 <= code < len(ALPHABET)
    pre: n_issued >= 0
    post: type(__return__) is ALPHABET[code].declaration.op
    """
    return _concrete(code, _Placeholders(n_issued))


def replay(codes: Sequence[int], config_code: int) -> Lockstep:
    """Replay ``codes`` on ``CONFIGS[config_code]`` concretely, e.g. a reported counterexample.

    Returns:
        The lockstep runner after the last operation, for inspection.

    Raises:
        ConformanceError: The allocator and the spec disagree; says where.
    """
    return _replay(codes, config_code, ALPHABET, CALLS)


def _replay(
    codes: Sequence[int], config_code: int, letters: tuple[Template, ...], calls: frozenset[str]
) -> Lockstep:
    lockstep = Lockstep(_allocator, CONFIGS[config_code], HISTORY_LEN, capabilities=calls)
    for code in codes:
        lockstep.apply(_concrete(code, lockstep.spec.names, letters))
    return lockstep


def replay_agrees_with_spec(codes: list[int], config_code: int) -> bool:
    """The allocator and the spec agree on everything after each decoded operation.

    pre: 0 <= config_code < len(CONFIGS)
    pre: len(codes) <= 4
    pre: all(0 <= c < N_BEFORE_SHARING for c in codes)
    post: __return__
    """
    # Its own letters and calls, not a prefix of the full ones: CrossHair's search per
    # step then costs what it did before sharing, and its counterexamples replay as is.
    try:
        _replay(codes, config_code, _BEFORE_SHARING, CALLS_BEFORE_SHARING)
    except ConformanceError:
        return False
    return True


def sharing_replay_agrees_with_spec(codes: list[int], config_code: int) -> bool:
    """As ``replay_agrees_with_spec``, over sequences that share, fork or copy on write.

    pre: 0 <= config_code < len(CONFIGS)
    pre: len(codes) <= 4
    pre: all(0 <= c < len(ALPHABET) for c in codes)
    pre: any(c >= N_BEFORE_SHARING for c in codes)
    post: __return__
    """
    try:
        replay(codes, config_code)
    except ConformanceError:
        return False
    return True


def allocate_agrees_with_spec(
    config_code: int, stream_code: int, n_tokens: int, owner: int
) -> bool:
    """A lockstep ``allocate`` of a symbolic token count and owner, then its ``free_all``.

    pre: 0 <= config_code < len(CONFIGS)
    pre: 0 <= stream_code < len(STREAMS)
    pre: -1 <= n_tokens <= 11
    pre: -1 <= owner <= 2
    post: __return__
    """
    lockstep = Lockstep(_allocator, CONFIGS[config_code], HISTORY_LEN, capabilities=CALLS)
    try:
        with plans_uncached():  # the owner and token count are symbolic here
            lockstep.apply(Allocate(STREAMS[stream_code], n_tokens, owner))
            lockstep.apply(FreeAll(owner))
    except ConformanceError:
        return False
    return True


# ---- properties of the spec alone ----------------------------------------------


def _fresh(config_code: int) -> model.PoolState:
    state = model.new_pool(CONFIGS[config_code], HISTORY_LEN)
    assert not isinstance(state, model.Err), f"CONFIGS[{config_code}] is rejected"
    return state


def _covers_its_tokens(op: object, before: model.PoolState, result: object) -> bool:
    """An allocation is enough blocks for its tokens (``allocate``'s promise)."""
    n_tokens = getattr(op, "n_tokens", None)
    assert isinstance(result, tuple) and isinstance(n_tokens, int), "a successful allocate"
    return len(result) * before.config.block_size >= n_tokens


#: What a successful call promises beyond the invariants, by call name.
PROMISES: Final[dict[str, Callable[[object, model.PoolState, object], bool]]] = {
    "allocate": _covers_its_tokens,
    "shrink": lambda op, before, result: isinstance(result, int) and result >= 0,
}


def _keeps_its_promise(
    before: model.PoolState, operation: object, after: model.PoolState, result: object
) -> bool:
    """What the transition promises beyond the invariants holds.

    Refused bad input changes nothing (an error that counts itself, exhaustion,
    adds only its counter and snapshot: another driver checks that);
    ``mark_used``, ``register_owner`` and ``release_owner`` never add a history
    snapshot; a successful call keeps its own promise (:data:`PROMISES`).
    """
    declaration = declaration_of(operation)
    if isinstance(result, model.Err):
        if Raised(result.kind.value) in {Raised(kind.value) for kind in declaration.counted_errors}:
            return True
        return after == before
    never_recorded = ("mark_used", "register_owner", "release_owner")
    if declaration.name in never_recorded and after.history != before.history:
        return False
    promise = PROMISES.get(declaration.name)
    return promise is None or bool(promise(operation, before, result))


def _free_counts(state: model.PoolState) -> tuple[int, ...]:
    return tuple(len(stack) for _, stack in state.free_lists)


def spec_replay_keeps_invariants(codes: list[int], config_code: int) -> bool:
    """Every state a decoded replay reaches satisfies every invariant of the spec.

    Each step also keeps what its transition's ``post:`` lines promise (an
    allocation covers its tokens, shrink returns a count, mark_used leaves
    history alone).

    pre: 0 <= config_code < len(CONFIGS)
    pre: len(codes) <= 5
    pre: all(0 <= c < len(ALPHABET) for c in codes)
    post: __return__
    """
    spec = SpecSide(_fresh(config_code))
    for label, code in enumerate(codes):
        operation = _concrete(code, spec.names)
        before = spec.state
        after, result = spec.predict(operation)
        if not invariants.all_invariants_hold(after):
            return False
        if not _keeps_its_promise(before, operation, after, result):
            return False
        spec.commit(label, after)
    return True


def spec_free_all_undoes_allocate(config_code: int, stream_code: int, n_tokens: int) -> bool:
    """``allocate`` then ``free_all`` of its owner frees every block, grown ones too.

    A refused allocation leaves the handles and free lists as they were.

    pre: 0 <= config_code < len(CONFIGS)
    pre: 0 <= stream_code < len(STREAMS)
    pre: 1 <= n_tokens <= 12
    post: __return__
    """
    before = _fresh(config_code)
    allocated, handles = transitions.allocate(before, STREAMS[stream_code], n_tokens, 5)
    if isinstance(handles, model.Err):
        unchanged = allocated.handles == before.handles
        return unchanged and _free_counts(allocated) == _free_counts(before)
    after, error = transitions.free_all(allocated, 5)
    return (
        error is None
        and sum(_free_counts(after)) == sum(_free_counts(before)) + after.counters.n_grown
        and model.live_handles(after) == ()
        and 5 not in after.registered
    )


def spec_allocate_covers_n_tokens(config_code: int, n_tokens: int, owner: int) -> bool:
    """A successful allocation is ``ceil(n_tokens / block_size)`` blocks holding ``n_tokens``.

    Every block but the last is full; all are distinct and belong to ``owner``.

    pre: 0 <= config_code < len(CONFIGS)
    pre: 1 <= n_tokens <= 12
    pre: 0 <= owner <= 3
    post: __return__
    """
    state = _fresh(config_code)
    size = state.config.block_size
    after, handles = transitions.allocate(state, "k", n_tokens, owner)
    if isinstance(handles, model.Err):
        return handles.kind is model.ErrorKind.EXHAUSTED
    views = [after.handles[h] for h in handles]
    return (
        len(views) == -(-n_tokens // size)
        and sum(v.n_used for v in views) == n_tokens
        and all(v.n_used == size for v in views[:-1])
        and all(v.owner == owner for v in views)
        and len({v.block_id for v in views}) == len(views)
    )


def spec_exhaustion_changes_only_its_counter(codes: list[int], config_code: int) -> bool:
    """An exhausted ``allocate`` leaves the state as it was but for ``n_exhausted`` and history.

    pre: 0 <= config_code < len(CONFIGS)
    pre: len(codes) <= 3
    pre: all(0 <= c < len(ALPHABET) for c in codes)
    post: __return__
    """
    spec = SpecSide(_fresh(config_code))
    for label, code in enumerate(codes):
        spec.commit(label, spec.predict(_concrete(code, spec.names))[0])
    state = spec.state
    after, result = transitions.allocate(state, "k", 7, 0)
    if not (isinstance(result, model.Err) and result.kind is model.ErrorKind.EXHAUSTED):
        return True
    counters = replace(state.counters, n_exhausted=state.counters.n_exhausted + 1)
    return replace(after, history=state.history) == replace(state, counters=counters)


def spec_growth_reissues_lowest_retired_first(retire_count: int, n_tokens: int) -> bool:
    """After ``shrink``, growth hands out the lowest retired ids, then ids above every issued one.

    pre: 0 <= retire_count <= 2
    pre: 1 <= n_tokens <= 10
    post: __return__
    """
    state = _fresh(2)  # "k" holds ids 0 and 1, "v" id 2; growth capped at 5 blocks
    shrunk, retired = transitions.shrink(state, "k", 2 - retire_count)
    after, handles = transitions.allocate(shrunk, "k", n_tokens, 0)
    if isinstance(handles, model.Err):
        return True
    ids = [after.handles[h].block_id for h in handles]
    grown = ids[len(transitions.free_list_for(shrunk, "k")) :]
    reissued = sorted(shrunk.retired)[: len(grown)]
    start = shrunk.next_block_id
    fresh = range(start, start + len(grown) - len(reissued))
    return retired == retire_count and grown == [*reissued, *fresh]
