"""A discrete-step model of a serving engine's use of a KV-cache block pool.

:class:`ServingEngine` drives a :class:`BlockPoolAllocator` the way a
continuous-batching server (vLLM-style) does, one decode iteration per
*step*. Each request holds two logical streams, keys and values, each with
``ceil(tokens / block_size)`` blocks. On a separate-KV pool they are
allocated with one call per stream (``"k"``, ``"v"``); on a shared-KV pool
with a single ``"kv"`` call that covers both, so that a request's
allocation is all or nothing in either layout.

One step, in order:

1. **Arrivals** join the back of the FIFO waiting queue.
2. **Decode**: every running request, oldest admission first, either aborts
   (its client left: ``free_all``) or appends one token to each stream. The
   token goes into the stream's last block (``mark_used`` with its new fill)
   or, when that block is full, into a fresh block (``allocate`` of one block
   per stream). A request that generated its last token completes
   (``free_all``).
3. **Admission**: waiting requests are admitted in FIFO order, allocating
   all the tokens they need on both streams (the prompt, plus the tokens they
   had generated if they were preempted). Admission stops at the first
   request that does not fit (head-of-line, so no request starves).
4. A sample of the pool's state is recorded.

Policies on :class:`BlockPoolExhaustedError`, and why:

* **At admission** the request simply stays at the head of the queue (on a
  separate-KV pool whose K list fit but V list did not, the K blocks are
  given back with ``free``). Counted as an admission failure; a request
  admitted later than the step it arrived is a *delayed admission*.
* **While decoding** (growth) the engine *preempts* the most recently admitted
  running request, possibly the growing one itself: ``free_all`` its blocks
  and put it back at the head of the queue, to be re-admitted later with
  its tokens recomputed (vLLM's recompute preemption). Evicting the newest
  request loses the least work and guarantees the oldest one always makes
  progress, so the run drains.
* A request that cannot fit even when it is the only one holding blocks can
  never run on this pool: it is *rejected* and dropped.

Every exhausted ``allocate`` call shows in the pool's ``n_exhausted``.

Complexity: a step is O(running + admitted) pool calls; memory is
O(running + waiting) plus the recorder's samples.
Thread safety: an engine is single-threaded; it must be the only user of its
pool while it runs (it reads the pool's global counters as its own).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
)
from veloxquant_mlx.memory.stream_supply import require_supply
from veloxquant_mlx.simulate.metrics import Recorder, StepSample
from veloxquant_mlx.simulate.workload import Request

STREAMS: tuple[str, ...] = ("k", "v")  # both map to "kv" on a shared-KV pool


class SimulationInvariantError(RuntimeError):
    """The pool, or the engine's view of it, broke an invariant during a run."""

    def __init__(self, step: int, detail: str) -> None:
        super().__init__(f"invariant broken at step {step}: {detail}")
        self.step = step  # steps simulated when the check failed


class SimulationOutOfMemoryError(RuntimeError):
    """The machine ran out of memory during a run: its options asked for too much.

    Not an invariant violation: no check failed, the pool could not be held.
    """

    def __init__(self, step: int, pool_blocks: int) -> None:
        super().__init__(
            f"out of memory at step {step:,} with a pool of {pool_blocks:,} blocks: these "
            "options need more memory than this machine has (ask for fewer --n-blocks, "
            "--max-blocks, --duration or --arrival-rate)"
        )
        self.step = step  # steps simulated when memory ran out


@dataclass
class RequestState:
    """A request's progress, whether waiting or running.

    Invariants: while waiting, ``tokens == 0``, ``blocks_held == 0`` and
    ``last_blocks == []``; while running, ``tokens >= 1`` token slots are
    filled on each stream, each stream holds ``ceil(tokens / block_size)``
    blocks (``blocks_held`` counts both streams) and ``last_blocks[i]`` is
    the last block of ``STREAMS[i]``. ``generated`` never decreases
    (preemption keeps generated tokens; they are recomputed, not redone).
    """

    request: Request
    generated: int = 0  # decode tokens produced so far
    tokens: int = 0  # token slots filled per stream: prompt + generated, while running
    blocks_held: int = 0  # blocks checked out, both streams together
    last_blocks: list[Block] = field(default_factory=list)  # one per stream, STREAMS order
    admitted_before: bool = False  # True after the first admission

    @property
    def owner(self) -> int:
        """The pool owner id: the request id."""
        return self.request.request_id


@dataclass
class EngineCounters:
    """Cumulative event counts of one engine. All start at zero and only grow."""

    blocks_handed_out: int = 0  # blocks returned by successful allocate() calls
    exhaustion_events: int = 0  # allocate() calls that raised BlockPoolExhaustedError
    admission_failures: int = 0  # admission attempts refused for lack of blocks
    delayed_admissions: int = 0  # requests first admitted after their arrival step
    preemptions: int = 0  # running requests evicted to let another grow
    rejected: int = 0  # requests that cannot fit in the pool even alone
    completed: int = 0  # requests that generated all their tokens
    aborted: int = 0  # requests abandoned by their client mid-decode
    prefill_tokens: int = 0  # prompt tokens written at first admission
    recomputed_tokens: int = 0  # tokens rewritten when re-admitting a preempted request
    decode_tokens: int = 0  # tokens generated


class ServingEngine:
    """Continuous-batching scheduler over one block pool (see the module doc).

    Invariants, between steps: every request is in exactly one of
    ``waiting``, ``running``, or done; the pool's blocks in use equal
    ``blocks_held``, the sum of the running requests' ``blocks_held``;
    ``slots_filled`` is the sum over running requests of ``tokens`` on both
    streams. :meth:`check` verifies these against the pool.
    """

    def __init__(
        self,
        pool: BlockPoolAllocator,
        *,
        recorder: Recorder | None = None,
        block_format: str = "fp16",
    ) -> None:
        """Set up an idle engine over ``pool``, which it must use exclusively."""
        self.pool = pool
        self.block_size = pool.config.block_size
        self.block_format = block_format  # format tag written on every block
        self.recorder = recorder if recorder is not None else Recorder()
        self.counters = EngineCounters()
        self.step_index = 0  # steps simulated so far (the index of the next one)
        self.waiting: deque[RequestState] = deque()  # FIFO; preempted go to the front
        self.running: dict[int, RequestState] = {}  # by owner, in admission order
        self.blocks_held = 0  # blocks held by running requests, per the engine
        self.slots_filled = 0  # token slots holding a token, both streams

    @property
    def idle(self) -> bool:
        """True when no request is waiting or running."""
        return not self.waiting and not self.running

    def step(self, arrivals: Iterable[Request]) -> None:
        """Simulate one step with ``arrivals`` joining the queue first."""
        for request in arrivals:
            self.recorder.record_arrival(request.prompt_len, request.decode_len)
            self.waiting.append(RequestState(request))
        self._decode_running()
        self._admit_waiting()
        self._record_sample()
        self.step_index += 1

    def check(self) -> None:
        """Run the pool's own invariant check and cross-check the engine's books.

        Raises:
            SimulationInvariantError: Either check failed; the original error
                is chained as the cause.
        """
        try:
            self.pool.check_invariants()
        except MemoryError:
            raise  # the check could not run: no invariant is known to be broken
        except Exception as error:
            raise SimulationInvariantError(
                self.step_index, f"pool.check_invariants() raised {error!r}"
            ) from error
        in_use = self.pool.stats.blocks_in_use()
        if in_use != self.blocks_held:
            raise SimulationInvariantError(
                self.step_index,
                f"pool has {in_use} blocks in use, engine holds {self.blocks_held}",
            )

    def check_drained(self) -> None:
        """After the last request: verify every block went back to a free list.

        Raises:
            SimulationInvariantError: Requests remain, or blocks were leaked.
        """
        self.check()
        if not self.idle:
            raise SimulationInvariantError(
                self.step_index,
                f"{len(self.waiting)} waiting and {len(self.running)} running at the end",
            )
        stats = self.pool.stats
        free = sum(self.pool.n_free(stream) for stream in self._free_list_names())
        if free != stats.n_blocks:
            raise SimulationInvariantError(
                self.step_index,
                f"expected all {stats.n_blocks} blocks free at the end, got {free}",
            )

    def _free_list_names(self) -> tuple[str, ...]:
        return STREAMS if self.pool.config.separate_kv else ("kv",)

    # -- decode -------------------------------------------------------------

    def _decode_running(self) -> None:
        for state in list(self.running.values()):
            if state.owner not in self.running:
                continue  # preempted earlier in this step to make room
            if state.generated == state.request.abort_after:
                self._finish(state)
                self.counters.aborted += 1
            elif self._append_token(state):
                state.generated += 1
                self.counters.decode_tokens += 1
                if state.generated == state.request.decode_len:
                    self._finish(state)
                    self.counters.completed += 1
                    self.recorder.record_completion(self.step_index - state.request.arrival_step)

    def _append_token(self, state: RequestState) -> bool:
        """Write one token on every stream; False if ``state`` lost its blocks."""
        if state.tokens % self.block_size == 0:
            last_blocks = self._grow(state)
            if last_blocks is None:
                return False
            state.last_blocks = last_blocks
        else:
            new_fill = state.tokens % self.block_size + 1
            for block in state.last_blocks:
                self.pool.mark_used(block, new_fill)
        state.tokens += 1
        self.slots_filled += len(STREAMS)
        return True

    def _grow(self, state: RequestState) -> list[Block] | None:
        """Give every stream of ``state`` one new block, preempting until it fits.

        Returns:
            The new last block of each stream, or ``None`` if ``state`` itself
            was preempted or rejected instead.
        """
        while True:
            last_blocks = self._allocate_streams(state, 1)
            if last_blocks is not None:
                return last_blocks
            victim = next(reversed(self.running.values()))
            if victim is state and len(self.running) == 1:
                self._reject(state)
                return None
            self._preempt(victim)
            if victim is state:
                return None

    def _allocate_streams(self, state: RequestState, n_tokens: int) -> list[Block] | None:
        """Allocate ``n_tokens`` slots on every stream for ``state``, all or nothing.

        Returns:
            The last block of each stream, in ``STREAMS`` order; ``None`` if
            the pool was exhausted (nothing stays allocated).
        """
        if self.pool.config.separate_kv:
            return self._allocate_separate(state, n_tokens)
        return self._allocate_shared(state, n_tokens)

    def _allocate_separate(self, state: RequestState, n_tokens: int) -> list[Block] | None:
        # One call per free list, after a look at both (stream_supply): a key checkout
        # given back when the value list is short would still count in the pool's peak
        # and growth, and in blocks_handed_out. The rollback below is for safety only.
        n_blocks = -(-n_tokens // self.block_size)
        try:
            require_supply(
                self.pool,
                dict.fromkeys(STREAMS, n_blocks),
                state.owner,
                self.block_format,
                self.pool.free,
            )
        except BlockPoolExhaustedError:
            self.counters.exhaustion_events += 1
            return None
        allocated: list[list[Block]] = []
        for stream in STREAMS:
            blocks = self._allocate(state, stream, n_tokens)
            if blocks is None:
                for earlier in allocated:
                    self._give_back(state, earlier)
                return None
            allocated.append(blocks)
        return [blocks[-1] for blocks in allocated]

    def _allocate_shared(self, state: RequestState, n_tokens: int) -> list[Block] | None:
        # One call covers K and V, so exhaustion leaves nothing to roll back.
        # The pool fills blocks in order, so ask for K's blocks full and V's
        # with the remainder last, then correct K's last block.
        per_stream = -(-n_tokens // self.block_size)
        tail = n_tokens - (per_stream - 1) * self.block_size
        total = (len(STREAMS) * per_stream - 1) * self.block_size + tail
        blocks = self._allocate(state, "kv", total)
        if blocks is None:
            return None
        last_blocks = blocks[per_stream - 1 :: per_stream]
        if tail != self.block_size:
            self.pool.mark_used(last_blocks[0], tail)
        return last_blocks

    def _allocate(self, state: RequestState, stream: str, n_tokens: int) -> list[Block] | None:
        """``pool.allocate`` for ``state``; ``None`` (and counted) on exhaustion."""
        try:
            blocks = self.pool.allocate(stream, n_tokens, state.owner, self.block_format)
        except BlockPoolExhaustedError:
            self.counters.exhaustion_events += 1
            return None
        self.counters.blocks_handed_out += len(blocks)
        state.blocks_held += len(blocks)
        self.blocks_held += len(blocks)
        return blocks

    def _give_back(self, state: RequestState, blocks: list[Block]) -> None:
        """Undo a partial allocation of ``state``'s."""
        self.pool.free(blocks)
        state.blocks_held -= len(blocks)
        self.blocks_held -= len(blocks)

    # -- leaving the running set --------------------------------------------

    def _release(self, state: RequestState) -> None:
        """Free all of ``state``'s blocks and forget its running state."""
        self.pool.free_all(state.owner)
        self.blocks_held -= state.blocks_held
        self.slots_filled -= state.tokens * len(STREAMS)
        state.blocks_held = 0
        state.tokens = 0
        state.last_blocks = []

    def _finish(self, state: RequestState) -> None:
        self._release(state)
        del self.running[state.owner]

    def _preempt(self, state: RequestState) -> None:
        self._finish(state)
        self.waiting.appendleft(state)
        self.counters.preemptions += 1

    def _reject(self, state: RequestState) -> None:
        self._finish(state)
        self.counters.rejected += 1

    # -- admission ------------------------------------------------------------

    def _admit_waiting(self) -> None:
        while self.waiting:
            head = self.waiting[0]
            if self._try_admit(head):
                self.waiting.popleft()
            elif not self.running:
                # The pool is empty and the head still does not fit: it never will.
                self.waiting.popleft()
                self.counters.rejected += 1
            else:
                self.counters.admission_failures += 1
                break

    def _try_admit(self, state: RequestState) -> bool:
        """Allocate ``state``'s tokens on every stream, all or nothing."""
        needed = state.request.prompt_len + state.generated
        last_blocks = self._allocate_streams(state, needed)
        if last_blocks is None:
            return False
        state.tokens = needed
        state.last_blocks = last_blocks
        self.slots_filled += needed * len(STREAMS)
        self.running[state.owner] = state
        self._count_admission(state, needed)
        return True

    def _count_admission(self, state: RequestState, tokens: int) -> None:
        if state.admitted_before:
            self.counters.recomputed_tokens += tokens
            return
        state.admitted_before = True
        self.counters.prefill_tokens += tokens
        waited = self.step_index - state.request.arrival_step
        if waited > 0:
            self.counters.delayed_admissions += 1
        self.recorder.record_admission(waited)

    # -- sampling -------------------------------------------------------------

    def _record_sample(self) -> None:
        stats = self.pool.stats
        in_use = stats.blocks_in_use()
        self.recorder.record_step(
            StepSample(
                blocks_in_use=in_use,
                fragmentation=stats.fragmentation(),
                wasted_slots=in_use * self.block_size - self.slots_filled,
                queue_len=len(self.waiting),
                running=len(self.running),
            )
        )
