"""The aliasing replay: random traces pass on both stores, planted bugs are caught.

Covers :mod:`veloxquant_mlx.testing.aliasing` (the engine and its CLI) and
:mod:`veloxquant_mlx.testing.traces` (the JSON-lines format and the
recorder). Each planted bug is a small subclass of a real store that breaks
one rule of the storage protocol; the replay must fail on it, at the right
op, with the right diagnosis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.numpy_storage import NumpyBlockStorage
from veloxquant_mlx.testing.aliasing import (
    AliasingReplay,
    ReplayError,
    StorageBackend,
    Values,
    main,
    mlx_backend,
    numpy_backend,
    replay,
    replay_file,
)
from veloxquant_mlx.testing.storage_conformance import (
    CANNED_TRACES,
    drive_random_trace,
    random_trace_test,
)
from veloxquant_mlx.testing.traces import (
    Allocate,
    Free,
    FreeAll,
    Op,
    Read,
    Shrink,
    StoreSpec,
    Sync,
    Trace,
    TraceFormatError,
    TraceRecorder,
    Write,
    dumps,
    load,
    loads,
    save,
)

NumpyArray = npt.NDArray[np.generic]

test_random_traces_replay_cleanly_on_numpy = random_trace_test(numpy_backend())
test_random_traces_replay_cleanly_on_mlx = random_trace_test(mlx_backend())
test_random_traces_replay_cleanly_on_mlx_with_lazy_writes = random_trace_test(
    mlx_backend(lazy_writes=True), max_examples=20
)

SHARED = PoolConfig(block_size=2, n_blocks=4, separate_kv=False)
SPEC = StoreSpec(n_layers=1, n_kv_heads=1, head_dim=2)


def trace(*ops: Op, pool: PoolConfig = SHARED) -> Trace:
    return Trace(pool, SPEC, ops)


def numpy_variant(store_class: type[NumpyBlockStorage]) -> StorageBackend[NumpyArray]:
    """The NumPy backend with ``store_class`` (a planted bug) in place of the real store."""

    def make(pool: BlockPoolAllocator, spec: StoreSpec) -> NumpyBlockStorage:
        return store_class(pool, spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.dtype)

    return dataclasses.replace(numpy_backend(), name=store_class.__name__, make_storage=make)


# -- traces: format and recording ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CANNED_TRACES))
def test_recorded_trace_round_trips_through_a_file_and_replays(name: str, tmp_path: Path) -> None:
    recorded = replay(CANNED_TRACES[name], numpy_backend()).trace()
    path = tmp_path / "trace.jsonl"
    save(recorded, path)
    assert load(path) == recorded
    assert replay_file(path, "numpy") == len(recorded.ops)
    assert replay_file(path, "mlx") == len(recorded.ops)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_trace_round_trips_and_replays_to_the_same_outcomes(data: st.DataObject) -> None:
    recorded = drive_random_trace(numpy_backend(), data, max_ops=20)
    reloaded = loads(dumps(recorded))
    assert reloaded == recorded
    assert replay(reloaded, numpy_backend()).trace() == recorded


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"op": "teleport"}', "'op' must be one of"),
        ('{"op": "free_all", "owner": "1"}', "'owner' must be an int"),
        ('{"op": "free_all", "owner": 1, "colour": 2}', "has no field"),
        ('{"op": "free", "handles": [[0]]}', "handle [call, position]"),
        ('{"op": "shrink", "stream": "k"}', "target_free"),
    ],
)
def test_a_bad_op_line_is_rejected_with_its_line_number(line: str, complaint: str) -> None:
    text = dumps(trace()) + line + "\n"
    with pytest.raises(TraceFormatError, match="line 2") as raised:
        loads(text)
    assert complaint in str(raised.value)


def test_a_bad_header_is_rejected() -> None:
    with pytest.raises(TraceFormatError, match="header"):
        loads('{"op": "sync"}\n')
    with pytest.raises(TraceFormatError, match="block_size"):
        loads(dumps(trace()).replace('"block_size":2', '"block_size":0'))


def test_a_header_with_an_unknown_key_is_rejected() -> None:
    text = dumps(trace()).replace('"version":1,', '"version":1,"colour":"red",')
    with pytest.raises(TraceFormatError, match=r"unknown key\(s\) \['colour'\]"):
        loads(text)


def test_a_partial_mark_survives_a_round_trip_and_only_when_set() -> None:
    partial = Trace(SHARED, SPEC, (Allocate(0, "kv", 2, 1),), partial=True)
    assert '"partial":true' in dumps(partial)
    assert loads(dumps(partial)).partial is True
    assert '"partial"' not in dumps(trace())
    assert loads(dumps(trace())).partial is False
    with pytest.raises(TraceFormatError, match='"partial" must be true or false'):
        loads(dumps(trace()).replace('"version":1,', '"version":1,"partial":"yes",'))


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"n_layers": 0}, ValueError),
        ({"head_dim": -1}, ValueError),
        ({"n_kv_heads": True}, TypeError),
        ({"n_layers": "two"}, TypeError),
        ({"dtype": ""}, TypeError),
    ],
)
def test_a_store_spec_refuses_sizes_that_are_not_positive_ints(
    fields: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error, match=next(iter(fields))):
        StoreSpec(**fields)  # type: ignore[arg-type]


def test_recorder_names_handles_of_a_live_session_and_its_trace_replays() -> None:
    pool = BlockPoolAllocator(SHARED)
    recorder = TraceRecorder(SHARED, SPEC)
    first = pool.allocate("kv", 3, owner=1)
    recorder.allocate("kv", 3, 1, result=first)
    pool.free(first[:1])
    recorder.free(first[:1])
    try:
        pool.free(first[:1])
    except ValueError as error:
        recorder.free(first[:1], error=error)
    recorder.write(0, first[1], 0, 2)
    ops = recorder.trace().ops
    assert ops[2] == Free(((0, 0),), expect="InvalidFreeError")
    assert ops[3] == Write(0, (0, 1), 0, 2, expect="ok")
    replay(recorder.trace(), numpy_backend())


def test_a_recorded_outcome_that_a_sequential_replay_contradicts_fails() -> None:
    contradicted = trace(Allocate(0, "kv", 2, 1), Free(((0, 0),)), Free(((0, 0),), expect="ok"))
    with pytest.raises(ReplayError) as raised:
        replay(contradicted, numpy_backend())
    assert raised.value.op_index == 2
    assert '"op":"free"' in str(raised.value)
    assert "the trace expects ok" in raised.value.detail


def test_a_handle_no_allocate_returned_is_a_malformed_trace() -> None:
    with pytest.raises(ReplayError, match="malformed trace") as raised:
        replay(trace(Allocate(0, "kv", 2, 1), Write(0, (0, 5), 0, 1)), numpy_backend())
    assert raised.value.op_index == 1


def test_allocate_ids_differing_from_the_trace_fail() -> None:
    with pytest.raises(ReplayError, match=r"returned block ids \[0\]"):
        replay(trace(Allocate(0, "kv", 2, 1, block_ids=(3,))), numpy_backend())


# -- the engine's laziness -----------------------------------------------------------------


def test_a_held_read_is_first_evaluated_when_its_hold_ends() -> None:
    base = mlx_backend()
    gathered: list[mx.array] = []  # every array the store returned, kept alive
    evaluated: list[mx.array] = []  # every array the engine evaluated

    class Recording(MLXBlockStorage):
        def gather(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> mx.array:
            gathered.append(super().gather(layer, blocks, n_tokens))
            return gathered[-1]

    def make(pool: BlockPoolAllocator, spec: StoreSpec) -> MLXBlockStorage:
        return Recording(pool, spec.n_layers, spec.n_kv_heads, spec.head_dim, mx.float32)

    def to_numpy(array: mx.array) -> Values:
        evaluated.append(array)
        return base.to_numpy(array)

    engine = AliasingReplay(
        SHARED, SPEC, dataclasses.replace(base, make_storage=make, to_numpy=to_numpy)
    )
    engine.apply(Allocate(0, "kv", 2, 1))
    first_gather_of_the_read = len(gathered)
    engine.apply(Read(0, ((0, 0),), 2, hold=2))
    held = gathered[first_gather_of_the_read]
    engine.apply(Write(0, (0, 0), 0, 2))
    assert not any(array is held for array in evaluated)
    engine.apply(Write(0, (0, 0), 1, 1))
    assert any(array is held for array in evaluated)


@pytest.mark.parametrize("lazy_writes", [False, True])
def test_mlx_reads_left_lazy_through_writes_growth_and_shrink_keep_their_values(
    lazy_writes: bool,
) -> None:
    replay(CANNED_TRACES["lazy-reads-across-resizes"], mlx_backend(lazy_writes=lazy_writes))


# -- planted bugs --------------------------------------------------------------------------


class TwoIdsOneSlotStorage(NumpyBlockStorage):
    """Planted bug: block id 1 is stored in block id 0's row."""

    def write(self, layer: int, block: Block, start: int, tokens: NumpyArray) -> None:
        super().write(layer, block, start, tokens)
        if block.block_id == 1:
            self._slabs[layer][0, start : start + len(tokens)] = tokens


class ViewReturningStorage(NumpyBlockStorage):
    """Planted bug: a one-block gather returns a view of the slab, which later writes reach."""

    def gather(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> NumpyArray:
        copy = super().gather(layer, blocks, n_tokens)  # checks the arguments
        if len(blocks) == 1:
            return self._slabs[layer][blocks[0].block_id, :n_tokens]
        return copy


class NeverShrinkingStorage(NumpyBlockStorage):
    """Planted bug: growth works but a retired tail is never given back."""

    def _resize_locked(self, target: int) -> None:
        if target > self._capacity:
            super()._resize_locked(target)


class StaleWriteAcceptingStorage(NumpyBlockStorage):
    """Planted bug: writes go by block id without asking the pool whether the handle is live."""

    def write(self, layer: int, block: Block, start: int, tokens: npt.NDArray[np.generic]) -> None:
        with self._lock:
            self._sync_locked()
            self._slabs[layer][block.block_id, start : start + len(tokens)] = tokens


class CachedGatherMLXStorage(MLXBlockStorage):
    """Planted bug: one cached array per block, kept fresh by assigning into it in place."""

    def __init__(self, pool: BlockPoolAllocator, spec: StoreSpec) -> None:
        super().__init__(pool, spec.n_layers, spec.n_kv_heads, spec.head_dim, mx.float32)
        self._cache: dict[tuple[int, int], mx.array] = {}

    def gather(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> mx.array:
        if len(blocks) != 1 or n_tokens != self._block_size:
            return super().gather(layer, blocks, n_tokens)
        key = (layer, blocks[0].block_id)
        if key not in self._cache:
            self._cache[key] = super().gather(layer, blocks, n_tokens)
        return self._cache[key]

    def write(self, layer: int, block: Block, start: int, tokens: mx.array) -> None:
        super().write(layer, block, start, tokens)
        cached = self._cache.get((layer, block.block_id))
        if cached is not None:
            cached[start : start + tokens.shape[0]] = tokens  # mutates the reader's array


def test_replay_catches_two_ids_sharing_storage() -> None:
    with pytest.raises(ReplayError) as raised:
        replay(trace(Allocate(0, "kv", 4, owner=1)), numpy_variant(TwoIdsOneSlotStorage))
    assert raised.value.op_index == 0
    assert (
        "live handle [0, 0] (block id 0) layer 0 slot 0 holds the values written to "
        "live handle [0, 1] (block id 1) slot 0: the two ids share storage" in str(raised.value)
    )


def test_replay_catches_a_read_that_a_later_write_leaks_into() -> None:
    ops = (Allocate(0, "kv", 2, owner=1), Read(0, ((0, 0),), 2), Write(0, (0, 0), 0, 1))
    with pytest.raises(ReplayError, match="changed after it was taken") as raised:
        replay(trace(*ops), numpy_variant(ViewReturningStorage))
    assert raised.value.op_index == 2
    assert "a later write leaked into an earlier read" in raised.value.detail


def test_replay_catches_an_mlx_read_mutated_in_place_even_when_evaluated_late() -> None:
    def make(pool: BlockPoolAllocator, spec: StoreSpec) -> CachedGatherMLXStorage:
        return CachedGatherMLXStorage(pool, spec)

    backend = dataclasses.replace(mlx_backend(), make_storage=make)
    ops = (
        Allocate(0, "kv", 2, owner=1),
        Read(0, ((0, 0),), 2, hold=1),
        Write(0, (0, 0), 0, 1),
        Sync(),
    )
    with pytest.raises(ReplayError, match="changed after it was taken") as raised:
        replay(trace(*ops), backend)
    assert raised.value.op_index == 2


def test_replay_catches_a_store_that_keeps_a_retired_tail() -> None:
    ops = (Allocate(0, "kv", 2, owner=1), Shrink("kv", 0, retired=3))
    with pytest.raises(ReplayError, match="does not follow the pool's id_bound 1") as raised:
        replay(trace(*ops), numpy_variant(NeverShrinkingStorage))
    assert raised.value.op_index == 1


def test_replay_catches_a_write_through_a_stale_handle() -> None:
    ops = (Allocate(0, "kv", 2, owner=1), FreeAll(1), Write(0, (0, 0), 0, 1))
    with pytest.raises(ReplayError, match="should have raised ValueError but succeeded") as raised:
        replay(trace(*ops), numpy_variant(StaleWriteAcceptingStorage))
    assert raised.value.op_index == 2


@pytest.mark.parametrize(
    ("store_class", "diagnosis"),
    [(TwoIdsOneSlotStorage, "share storage"), (ViewReturningStorage, "changed after")],
)
def test_random_traces_find_a_planted_bug(
    store_class: type[NumpyBlockStorage], diagnosis: str
) -> None:
    backend = numpy_variant(store_class)

    # Generation only: finding the bug is the point here, shrinking it is not.
    @settings(
        max_examples=300, phases=[Phase.generate], database=None, deadline=None, derandomize=True
    )
    @given(data=st.data())
    def find_bug(data: st.DataObject) -> None:
        drive_random_trace(backend, data, max_ops=30)

    with pytest.raises(ReplayError, match=diagnosis):
        find_bug()


# -- command line --------------------------------------------------------------------------


def test_cli_replays_a_clean_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "clean.jsonl"
    save(CANNED_TRACES["stale-handles"], path)
    assert main([str(path), "--backend", "numpy"]) == 0
    assert "ops replayed on numpy: ok" in capsys.readouterr().out


def test_cli_reports_the_first_failing_op(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "failing.jsonl"
    save(trace(Allocate(0, "kv", 2, owner=1), Free(((0, 0),)), Free(((0, 0),), expect="ok")), path)
    assert main([str(path), "--backend", "mlx"]) == 1
    assert "FAILED: op #2" in capsys.readouterr().err
