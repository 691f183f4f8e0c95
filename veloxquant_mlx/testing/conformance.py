"""The conformance kit: a Hypothesis state machine that checks an allocator against the spec.

A port of the block pool to another backend (a Rust extension, a CUDA
allocator with a Python binding, ...) proves itself against our executable
spec in a few lines::

    from veloxquant_mlx.testing.conformance import conformance_test_case

    TestMyPool = conformance_test_case(lambda config, history_len: MyPool(
        config, history_len=history_len))

pytest (or unittest) then runs :class:`PoolConformanceMachine` on it: random
pools (both stream modes, growth on and off, ``max_blocks``, ``n_blocks``
from 0, tiny and large history) and random sequences of every public
operation, with stale handles, foreign handles, junk, double frees and bad
arguments mixed in. After every step :class:`~veloxquant_mlx.testing.
lockstep.Lockstep` compares everything observable with the spec. The
Hypothesis profile (``ci``, ``nightly``, ``mutation``) comes from
:mod:`veloxquant_mlx.testing.profiles`.

Requires the ``dev`` extra (Hypothesis). Complexity: per step O(handles
issued). Thread safety: each machine instance drives its own allocator.
"""

from __future__ import annotations

import unittest
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.testing.lockstep import AllocatorFactory, AllocatorUnderTest, Lockstep
from veloxquant_mlx.testing.operations import (
    Allocate,
    ForeignBlock,
    Free,
    FreeAll,
    HandleRef,
    MarkUsed,
    NotABlock,
    NotAList,
    Operation,
    RegisterOwner,
    ReleaseOwner,
    Shrink,
)
from veloxquant_mlx_spec import model

#: Wrong-typed values for int arguments (bool is not an int here).
BAD_INTS: tuple[object, ...] = (True, False, 1.0, "1", None)
OWNERS = st.integers(0, 2)
BAD_OWNERS = st.sampled_from(BAD_INTS)
STREAMS = st.sampled_from(["k", "v", "kv"])  # "kv" is invalid in a separate-K/V pool
BAD_STREAMS = st.sampled_from(["K", "", "kv ", 0, None, b"k"])
FORMATS = st.sampled_from(["fp16", "int4", "int2"])
BAD_FORMATS = st.sampled_from(["", b"fp16", 4, None])
TOKEN_COUNTS = st.integers(1, 12)
BAD_TOKEN_COUNTS = st.one_of(st.integers(-2, 0), st.sampled_from(BAD_INTS))


def bad_calls(block: HandleRef) -> st.SearchStrategy[Operation]:
    """Calls with exactly one argument of the wrong type or value."""
    return st.one_of(
        st.builds(Allocate, BAD_STREAMS, TOKEN_COUNTS, OWNERS, FORMATS),
        st.builds(Allocate, STREAMS, BAD_TOKEN_COUNTS, OWNERS, FORMATS),
        st.builds(Allocate, STREAMS, TOKEN_COUNTS, BAD_OWNERS, FORMATS),
        st.builds(Allocate, STREAMS, TOKEN_COUNTS, OWNERS, BAD_FORMATS),
        st.just(Free(NotAList())),
        st.builds(FreeAll, BAD_OWNERS),
        st.builds(RegisterOwner, BAD_OWNERS),
        st.builds(ReleaseOwner, BAD_OWNERS),
        st.builds(Shrink, BAD_STREAMS, st.integers(0, 4)),
        st.builds(Shrink, STREAMS, BAD_TOKEN_COUNTS),
        st.builds(MarkUsed, st.just(block), st.one_of(st.sampled_from([-1, 17]), BAD_TOKEN_COUNTS)),
        st.builds(MarkUsed, st.just(NotABlock()), st.integers(0, 4)),
    )


def default_factory(config: PoolConfig, history_len: int) -> AllocatorUnderTest:
    """Our own allocator, the default system under test."""
    return BlockPoolAllocator(config, history_len=history_len)


@st.composite
def spec_configs(draw: st.DrawFn) -> model.SpecConfig:
    """Small valid pools: both stream modes, growth on/off, caps, ``n_blocks`` from 0."""
    n_blocks = draw(st.integers(0, 8))
    grow = draw(st.booleans())
    max_blocks = draw(st.one_of(st.none(), st.integers(n_blocks, n_blocks + 4)))
    config = model.make_config(
        block_size=draw(st.sampled_from([1, 2, 3, 4, 16])),
        n_blocks=n_blocks,
        separate_kv=draw(st.booleans()),
        grow_on_exhaustion=grow,
        max_blocks=max_blocks,
    )
    assert not isinstance(config, model.Err), config
    return config


class PoolConformanceMachine(RuleBasedStateMachine):
    """Random operation sequences on an allocator and the spec, compared after every step.

    Subclass and set ``allocator_factory`` to test another allocator (or use
    :func:`conformance_test_case`). Invariant: ``self.lockstep`` agrees with
    the spec after every rule (each rule goes through ``Lockstep.apply``).
    """

    allocator_factory: ClassVar[AllocatorFactory] = staticmethod(default_factory)

    def __init__(self) -> None:
        super().__init__()
        self.lockstep: Lockstep | None = None

    @property
    def runner(self) -> Lockstep:
        assert self.lockstep is not None, "the pool is built by the initialize rule"
        return self.lockstep

    @initialize(config=spec_configs(), history_len=st.sampled_from([0, 1, 3, 1024]))
    def build_pool(self, config: model.SpecConfig, history_len: int) -> None:
        self.lockstep = Lockstep(type(self).allocator_factory, config, history_len)

    def _block_refs(self, data: st.DataObject) -> HandleRef:
        """A live handle (most often), any handle, a foreign block, or junk."""
        live = list(model.live_handles(self.runner.state))
        issued = len(self.runner.handles)
        options: list[st.SearchStrategy[HandleRef]] = [
            st.builds(ForeignBlock, st.one_of(st.none(), st.integers(0, 2))),
            st.just(NotABlock()),
        ]
        if issued:
            options.insert(0, st.integers(0, issued - 1))
        if live:
            options = [st.sampled_from(live)] * 3 + options
        return data.draw(st.one_of(options))

    @rule(stream=STREAMS, owner=OWNERS, format=FORMATS, data=st.data())
    def allocate(self, stream: str, owner: int, format: str, data: st.DataObject) -> None:
        block_size = self.runner.state.config.block_size
        n_tokens = data.draw(st.integers(1, 3 * block_size + 1))
        self.runner.apply(Allocate(stream, n_tokens, owner, format))

    @rule(stream=STREAMS, owner=OWNERS, data=st.data())
    def allocate_one_block(self, stream: str, owner: int, data: st.DataObject) -> None:
        n_tokens = data.draw(st.integers(1, self.runner.state.config.block_size))
        self.runner.apply(Allocate(stream, n_tokens, owner))

    @rule(data=st.data(), size=st.integers(0, 4), as_tuple=st.booleans())
    def free(self, data: st.DataObject, size: int, as_tuple: bool) -> None:
        refs = tuple(self._block_refs(data) for _ in range(size))
        self.runner.apply(Free(refs, as_tuple))

    @precondition(lambda self: bool(model.live_handles(self.runner.state)))
    @rule(data=st.data())
    def free_live_handles(self, data: st.DataObject) -> None:
        live = model.live_handles(self.runner.state)
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        self.runner.apply(Free(tuple(chosen)))

    @precondition(lambda self: bool(model.live_handles(self.runner.state)))
    @rule(data=st.data())
    def free_a_live_handle_twice_in_one_call(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(model.live_handles(self.runner.state)))
        self.runner.apply(Free((handle, handle)))

    @rule(owner=OWNERS)
    def free_all(self, owner: int) -> None:
        self.runner.apply(FreeAll(owner))

    @rule(owner=OWNERS, register=st.booleans())
    def register_or_release_owner(self, owner: int, register: bool) -> None:
        self.runner.apply(RegisterOwner(owner) if register else ReleaseOwner(owner))

    @rule(stream=STREAMS, target_free=st.integers(0, 4))
    def shrink(self, stream: str, target_free: int) -> None:
        self.runner.apply(Shrink(stream, target_free))

    @rule(data=st.data(), n_used=st.integers(0, 16))
    def mark_used(self, data: st.DataObject, n_used: int) -> None:
        self.runner.apply(MarkUsed(self._block_refs(data), n_used))

    @rule(data=st.data())
    def call_with_a_bad_argument(self, data: st.DataObject) -> None:
        self.runner.apply(data.draw(bad_calls(self._block_refs(data))))

    @invariant()
    def everything_observable_matches_the_spec(self) -> None:
        if self.lockstep is not None:
            self.lockstep.compare_observations()


def conformance_test_case(factory: AllocatorFactory) -> type[unittest.TestCase]:
    """A ``TestCase`` running the conformance machine against ``factory``'s allocators.

    Args:
        factory: ``(PoolConfig, history_len) -> allocator`` with the reference API.

    Returns:
        A test case class; bind it to a ``Test*`` name in a test module.
    """

    class PortConformanceMachine(PoolConformanceMachine):
        allocator_factory: ClassVar[AllocatorFactory] = staticmethod(factory)

    test_case: type[unittest.TestCase] = PortConformanceMachine.TestCase
    return test_case
