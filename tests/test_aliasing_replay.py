"""The aliasing replay: random traces pass on both stores, planted bugs are caught.

Covers :mod:`veloxquant_mlx.testing.aliasing` (the engine and its CLI) and
:mod:`veloxquant_mlx.testing.traces` (the one JSON-lines format, its version 1
upgrade, and the recorder). Each planted bug is a small subclass of a real
store that breaks one rule of the storage protocol; the replay must fail on
it, at the right line, with the right diagnosis.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from veloxquant_mlx import cli
from veloxquant_mlx.commandline import progress
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.numpy_storage import NumpyBlockStorage
from veloxquant_mlx.stress import reproducer
from veloxquant_mlx.stress.reproducer import replay_trace
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
from veloxquant_mlx.testing.storage_backends import TOKEN_DTYPES
from veloxquant_mlx.testing.storage_conformance import (
    CANNED_TRACES,
    drive_random_trace,
    random_trace_test,
)
from veloxquant_mlx.testing.store_operations import Gather, Sync, Write
from veloxquant_mlx.testing.traces import (
    StoreSpec,
    Trace,
    TraceFormatError,
    TraceLine,
    TraceRecorder,
    dumps,
    load,
    loads,
    save,
)
from veloxquant_mlx_spec.operations import (
    Allocate,
    Free,
    FreeAll,
    MakeWritable,
    MarkUsed,
    Prometheus,
    Share,
    Shrink,
)
from veloxquant_mlx_spec.table import Raised, Returned, h

NumpyArray = npt.NDArray[np.generic]

test_random_traces_replay_cleanly_on_numpy = random_trace_test(numpy_backend())
test_random_traces_replay_cleanly_on_mlx = random_trace_test(mlx_backend())
test_random_traces_replay_cleanly_on_mlx_with_lazy_writes = random_trace_test(
    mlx_backend(lazy_writes=True), max_examples=20
)

SHARED = PoolConfig(block_size=2, n_blocks=4, separate_kv=False)
SPEC = StoreSpec(n_layers=1, n_kv_heads=1, head_dim=2)


def trace(*lines: TraceLine | object, pool: PoolConfig = SHARED) -> Trace:
    """A trace of these lines (a bare op is a line of its own, labelled by position)."""
    made = [
        line if isinstance(line, TraceLine) else TraceLine(line, index)
        for index, line in enumerate(lines)
    ]
    return Trace(pool, SPEC, tuple(made))


@pytest.mark.parametrize("dtype", [d for d in TOKEN_DTYPES if d != "bfloat16"])
def test_every_token_dtype_holds_each_sentinel_past_its_range_exactly(dtype: str) -> None:
    # 65,536 values in one allocate: uint16's sentinels once wrapped past 65,535 and
    # the replay failed the store with "live handle ... holds [65473.0, ...]".
    pool = PoolConfig(block_size=1024, n_blocks=2)
    store = StoreSpec(n_layers=1, n_kv_heads=4, head_dim=16, dtype=dtype)
    replay(Trace(pool, store, (TraceLine(Allocate("k", 1024, 0), 0),)), numpy_backend())


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
    assert replay_file(path, "numpy") == len(recorded.lines)
    assert replay_file(path, "mlx") == len(recorded.lines)


@pytest.mark.parametrize("on", ["spec", "pool", "numpy"])
def test_a_long_replay_says_how_far_it_got(on: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 120,000 lines once replayed for minutes without a word.
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setattr(progress, "PROGRESS_CLOCK_EVERY", 2)
    recorded = replay(CANNED_TRACES["stale-handles"], numpy_backend()).trace()
    said: list[str] = []
    verdict, _ = replay_trace(recorded, on, progress=said.append)
    assert verdict is Verdict.OK
    total = len(recorded.lines)
    assert [re.sub(r", \d+ s$", "", line) for line in said] == [
        f"{n:,} of {total:,} lines" for n in range(2, total + 1, 2)
    ]
    assert all(re.search(r", \d+ s$", line) for line in said)


@pytest.mark.parametrize(
    "command", [["replay", "{path}", "--on", "numpy"], ["stress", "--replay", "{path}"]]
)
def test_the_commands_print_replay_progress_on_stderr_unless_no_progress(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setattr(progress, "PROGRESS_CLOCK_EVERY", 1)
    path = tmp_path / "trace.jsonl"
    save(replay(CANNED_TRACES["stale-handles"], numpy_backend()).trace(), path)
    args = [str(path) if arg == "{path}" else arg for arg in command]
    assert cli.main(args) == 0
    assert f"  {path}: 1 of " in capsys.readouterr().err
    assert cli.main([*args, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


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
        ('{"op": "free_all", "owner": {"x": 1}}', "field 'owner': expected a JSON value"),
        ('{"op": "free_all", "owner": 1, "colour": 2}', "has no field"),
        ('{"op": "free", "blocks": [[0]]}', "handle [call, position]"),
        ('{"op": "shrink", "stream": "k"}', "target_free"),
        ('{"op": "allocate", "stream": "k", "n_tokens": 1, "owner": 1}', "needs a 'call' label"),
        ('{"op": "free_all", "owner": 1, "returned": 3}', "'returned' needs"),
        (
            '{"op": "n_free", "stream": "k", "thread": 0, "invoke_ns": 9, "return_ns": 8}',
            "return_ns must be >= invoke_ns (9): a call returns after it starts, got 8",
        ),
    ],
)
def test_a_bad_op_line_is_rejected_with_its_line_number(line: str, complaint: str) -> None:
    text = dumps(trace()) + line + "\n"
    with pytest.raises(TraceFormatError, match="line 2") as raised:
        loads(text)
    assert complaint in str(raised.value)


def test_a_recorded_nan_is_refused_when_written_not_when_the_file_is_read() -> None:
    # A NaN in a returned value was written as NaN, which the loader refuses.
    metrics = Returned((("veloxquant_block_pool_fragmentation_ratio", float("nan")),))
    with pytest.raises(TraceFormatError, match="must be finite to be written, got nan"):
        dumps(trace(TraceLine(Prometheus(), 0, metrics)))


def test_a_call_label_used_twice_is_rejected_naming_both_lines() -> None:
    text = dumps(trace()) + '{"op": "free_all", "call": 4, "owner": 1}\n' * 2
    with pytest.raises(TraceFormatError, match="line 3: call label 4 is already line 2's"):
        loads(text)


@pytest.mark.parametrize(
    ("lines", "complaint"),
    [
        ((Allocate("kv", 2, 1), Free((h(5, 0),))), "line 3: names handle h(5, 0)"),
        ((Free((h(1, 0),)), Allocate("kv", 2, 1)), "line 2: names handle h(1, 0)"),
        ((FreeAll(1), MarkUsed(h(0, 0), 1)), "line 3: names handle h(0, 0)"),
        (
            (
                TraceLine(Allocate("kv", 9, 1), 0, Raised("BlockPoolExhaustedError")),
                Write(0, h(0, 0), 0, 1),
            ),
            "line 3: names handle h(0, 0)",
        ),
    ],
    ids=["no-such-label", "a-later-line", "hands-out-none", "raised"],
)
def test_a_handle_no_earlier_call_handed_out_is_refused_when_the_trace_loads(
    lines: tuple[object, ...], complaint: str
) -> None:
    with pytest.raises(TraceFormatError, match=re.escape(complaint)) as raised:
        loads(dumps(trace(*lines)))
    assert "no call of the trace handed it out" in str(raised.value)


def _timed(op: object, call: int | None, thread: int, at: int) -> TraceLine:
    outcome = Returned((0,)) if isinstance(op, Allocate) else Returned(None)
    return TraceLine(op, call, outcome, thread=thread, invoke_ns=at, return_ns=at + 1)


def test_a_timed_line_may_name_a_handle_of_a_call_listed_after_it_in_its_window() -> None:
    # A concurrent window's lines come in no particular order: the search linearizes them.
    window = trace(_timed(Free((h(1, 0),)), None, 0, 5), _timed(Allocate("kv", 2, 1), 1, 1, 1))
    assert loads(dumps(window)) == window


@pytest.mark.parametrize("later", ["untimed", "next-window"])
def test_a_timed_line_naming_a_handle_of_a_call_after_its_window_is_refused(later: str) -> None:
    # Once such a trace loaded, and the spec replay said ok where the pool replay FAILED.
    issue = TraceLine(Allocate("kv", 2, 1), 1, Returned((0,)))
    if later == "next-window":
        issue = _timed(Allocate("kv", 2, 1), 1, 1, 9)
    window = trace(_timed(Free((h(1, 0),)), None, 0, 5), TraceLine(FreeAll(7)), issue)
    with pytest.raises(TraceFormatError, match=re.escape("line 2: names handle h(1, 0)")):
        loads(dumps(window))


def test_a_partial_trace_may_name_handles_of_calls_it_does_not_hold() -> None:
    # A stress reproducer written without the calls before its window is marked partial.
    window = Trace(SHARED, SPEC, (_timed(Free((h(0, 0),)), None, 0, 5),), partial=True)
    assert loads(dumps(window)) == window


def test_a_replayed_trace_keeps_unlabelled_lines_unlabelled() -> None:
    # Once labelled by position, an unlabelled line took a label a later line already had.
    given = trace(TraceLine(Allocate("kv", 2, 1), 0), TraceLine(Free((h(0, 0),))))
    given = given.with_lines([*given.lines, TraceLine(Allocate("kv", 2, 2), 1)])
    recorded = replay(given, numpy_backend()).trace()
    assert [line.call for line in recorded.lines] == [0, None, 1]
    assert loads(dumps(recorded)) == recorded


def test_a_bad_header_is_rejected() -> None:
    with pytest.raises(TraceFormatError, match="header"):
        loads('{"op": "sync"}\n')
    with pytest.raises(TraceFormatError, match="block_size"):
        loads(dumps(trace()).replace('"block_size":2', '"block_size":0'))


@pytest.mark.parametrize("history_len", [-1, True, 2**63, 10**30])
def test_a_header_history_len_no_pool_can_keep_is_rejected(history_len: object) -> None:
    # 10**30 once loaded, and the replay on a pool died in a MemoryError traceback.
    written = json.dumps(history_len)
    text = dumps(trace()).replace('"history_len":0', f'"history_len":{written}')
    with pytest.raises(TraceFormatError, match='"history_len" must be an int from 0 to'):
        loads(text)
    assert loads(text.replace(written, str(2**63 - 1))).history_len == 2**63 - 1


def test_a_header_with_an_unknown_key_is_rejected() -> None:
    text = dumps(trace()).replace('"version":2,', '"version":2,"colour":"red",')
    with pytest.raises(TraceFormatError, match=r"unknown key\(s\) \['colour'\]"):
        loads(text)


def test_a_partial_mark_survives_a_round_trip_and_only_when_set() -> None:
    partial = Trace(SHARED, SPEC, (TraceLine(Allocate("kv", 2, 1), 0),), partial=True)
    assert '"partial":true' in dumps(partial)
    assert loads(dumps(partial)).partial is True
    assert '"partial"' not in dumps(trace())
    assert loads(dumps(trace())).partial is False
    with pytest.raises(TraceFormatError, match='"partial" must be true or false'):
        loads(dumps(trace()).replace('"version":2,', '"version":2,"partial":"yes",'))


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
    pool = BlockPoolAllocator(SHARED, history_len=0)
    recorder = TraceRecorder(SHARED, SPEC)
    first = recorder.call(lambda: pool.allocate("kv", 3, owner=1), Allocate("kv", 3, 1))
    assert isinstance(first, list)
    recorder.call(lambda: pool.free(first[:1]), Free(recorder.names(first[:1])))
    with pytest.raises(ValueError, match="not a live handle"):
        recorder.call(lambda: pool.free(first[:1]), Free(recorder.names(first[:1])))
    recorder.record(Write(0, recorder.name_of(first[1]), 0, 2))
    lines = recorder.trace().lines
    assert lines[0] == TraceLine(Allocate("kv", 3, 1), 0, Returned((0, 1)))
    assert lines[2] == TraceLine(Free((h(0, 0),)), 2, Raised("InvalidFreeError"))
    assert lines[3] == TraceLine(Write(0, h(0, 1), 0, 2), 3, Returned(None))
    replay(recorder.trace(), numpy_backend())


def test_recorder_names_the_handle_make_writable_moves_and_keeps_one_it_returns() -> None:
    pool = BlockPoolAllocator(SHARED, history_len=0)
    recorder = TraceRecorder(SHARED, SPEC)
    first = recorder.call(lambda: pool.allocate("kv", 2, owner=1), Allocate("kv", 2, 1))
    assert isinstance(first, list)
    shared = recorder.call(lambda: pool.share(first, 2), Share(recorder.names(first), 2))
    assert isinstance(shared, list)
    moved = recorder.call(
        lambda: pool.make_writable(shared[0]), MakeWritable(recorder.name_of(shared[0]))
    )
    assert isinstance(moved, Block)
    recorder.record(Write(0, recorder.name_of(moved), 0, 2))
    recorder.call(lambda: pool.free([first[0]]), Free(recorder.names([first[0]])))
    same = recorder.call(lambda: pool.make_writable(moved), MakeWritable(recorder.name_of(moved)))
    assert same is moved
    assert recorder.name_of(moved) == h(2, 0)
    replay(recorder.trace(), numpy_backend())


def test_a_version_1_trace_loads_upgraded_to_the_api_names() -> None:
    v1 = "\n".join(
        [
            '{"trace":"veloxquant-mlx","version":1,"pool":{"block_size":2,"n_blocks":4,'
            '"separate_kv":false,"grow_on_exhaustion":false,"max_blocks":null},'
            '"store":{"n_layers":1,"n_kv_heads":1,"head_dim":2,"dtype":"float32"}}',
            '{"op":"allocate","call":0,"stream":"kv","n_tokens":3,"owner":1,"block_ids":[0,1]}',
            '{"op":"read","layer":0,"handles":[[0,0]],"n_tokens":2,"expect":"ok"}',
            '{"op":"mark_used","handle":[0,1],"n_used":1}',
            '{"op":"shrink","stream":"kv","target_free":0,"retired":2,"expect":"ok"}',
        ]
    )
    upgraded = loads(v1)
    assert upgraded.history_len == 0
    assert [line.op for line in upgraded.lines] == [
        Allocate("kv", 3, 1),
        Gather(0, (h(0, 0),), 2),
        MarkUsed(h(0, 1), 1),
        Shrink("kv", 0),
    ]
    assert upgraded.lines[0].outcome == Returned((0, 1))
    assert upgraded.lines[3].outcome == Returned(2)
    replay(upgraded, numpy_backend())


OK_WITHOUT_RETURNED = (
    '{"trace":"veloxquant-mlx","version":2,"pool":{"block_size":4,"n_blocks":8}}\n'
    '{"op":"allocate","call":0,"stream":"k","n_tokens":5,"owner":1,"expect":"ok"}\n'
    '{"op":"share","call":1,"blocks":[[0,0]],"owner":2,"expect":"ok"}\n'
)


@pytest.mark.parametrize("on", ["spec", "pool", "numpy"])
def test_an_ok_line_without_returned_accepts_any_return_but_not_an_error(on: str) -> None:
    assert replay_trace(loads(OK_WITHOUT_RETURNED), on) == (
        Verdict.OK,
        f"2 ops replayed on {on}: ok",
    )
    refused = OK_WITHOUT_RETURNED + '{"op":"free","blocks":[[0,0],[0,0]],"expect":"ok"}\n'
    verdict, why = replay_trace(loads(refused), on)
    assert verdict is Verdict.VIOLATION
    assert "the spec: raised InvalidFreeError" in why


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ('{"reproducer": "veloxquant-mlx-linearizability", "version": 1}', "v1 reproducer"),
        ('[{"scope": "separate-4"}]', "a JSON array"),
        ('{"trace": "veloxquant-mlx", "version": 3, "pool": {}}', "version 3 is not supported"),
    ],
)
def test_a_file_in_another_format_is_refused_naming_the_format_expected(
    text: str, complaint: str
) -> None:
    with pytest.raises(TraceFormatError, match=complaint) as raised:
        loads(text + "\n")
    assert '"version": 2' in str(raised.value) or "expected 2" in str(raised.value)


V1_REPRODUCER = {
    "reproducer": "veloxquant-mlx-linearizability",
    "version": 1,
    "pool": {"block_size": 4, "n_blocks": 8},
    "history_len": 0,
    "starts": [],
    "window": [],
    "message": "",
}


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(V1_REPRODUCER, indent=1),  # as version 1 wrote it
        json.dumps(V1_REPRODUCER, separators=(",", ":")),  # compact, on one line
        json.dumps(dict(reversed(V1_REPRODUCER.items())), indent=4),  # its key elsewhere
    ],
    ids=["indented", "compact", "key-last"],
)
def test_a_v1_reproducer_is_named_whatever_its_layout(text: str) -> None:
    with pytest.raises(TraceFormatError, match="v1 reproducer: this version replays trace"):
        loads(text + "\n")


def test_a_recorded_outcome_that_a_sequential_replay_contradicts_fails() -> None:
    contradicted = trace(
        Allocate("kv", 2, 1),
        Free((h(0, 0),)),
        TraceLine(Free((h(0, 0),)), outcome=Returned(None)),
    )
    with pytest.raises(ReplayError) as raised:
        replay(contradicted, numpy_backend())
    assert raised.value.op_index == 2
    assert '"op":"free"' in str(raised.value)
    assert "the trace records it returned None" in raised.value.detail


def test_a_handle_no_allocate_returned_is_a_malformed_trace() -> None:
    with pytest.raises(ReplayError, match="malformed trace") as raised:
        replay(trace(Allocate("kv", 2, 1), Write(0, h(0, 5), 0, 1)), numpy_backend())
    assert raised.value.op_index == 1
    with pytest.raises(ReplayError, match=r"malformed trace: no call returned a handle h\(7, 0\)"):
        replay(trace(Allocate("kv", 2, 1), Free((h(7, 0),))), numpy_backend())


def test_allocate_ids_differing_from_the_trace_fail() -> None:
    recorded = TraceLine(Allocate("kv", 2, 1), 0, Returned((3,)))
    with pytest.raises(ReplayError, match=r"returned \(0,\); the trace records it returned \(3,\)"):
        replay(trace(recorded), numpy_backend())


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
    engine.apply(TraceLine(Allocate("kv", 2, 1), 0))
    first_gather_of_the_read = len(gathered)
    engine.apply(TraceLine(Gather(0, (h(0, 0),), 2, hold=2)))
    held = gathered[first_gather_of_the_read]
    engine.apply(TraceLine(Write(0, h(0, 0), 0, 2)))
    assert not any(array is held for array in evaluated)
    engine.apply(TraceLine(Write(0, h(0, 0), 1, 1)))
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
        replay(trace(Allocate("kv", 4, owner=1)), numpy_variant(TwoIdsOneSlotStorage))
    assert raised.value.op_index == 0
    assert (
        "live handle h(0, 0) (block id 0) layer 0 slot 0 holds the values written to "
        "live handle h(0, 1) (block id 1) slot 0: the two ids share storage" in str(raised.value)
    )


def test_replay_catches_a_read_that_a_later_write_leaks_into() -> None:
    ops = (Allocate("kv", 2, owner=1), Gather(0, (h(0, 0),), 2), Write(0, h(0, 0), 0, 1))
    with pytest.raises(ReplayError, match="changed after it was taken") as raised:
        replay(trace(*ops), numpy_variant(ViewReturningStorage))
    assert raised.value.op_index == 2
    assert "a later write leaked into an earlier read" in raised.value.detail


@pytest.mark.parametrize("hold", [2, 5])
def test_a_read_held_past_the_last_line_is_still_checked_at_the_end(hold: int) -> None:
    # Once never checked: a held read was first evaluated when its hold ended, and a
    # trace that ended first let a write leak into it unseen.
    ops = (Allocate("kv", 2, owner=1), Gather(0, (h(0, 0),), 2, hold=hold), Write(0, h(0, 0), 0, 1))
    with pytest.raises(ReplayError, match="at the end: the array returned by read op #1") as raised:
        replay(trace(*ops), numpy_variant(ViewReturningStorage))
    assert raised.value.op_index == 2
    replay(trace(*ops), numpy_backend())  # a sound store


class _Unreadable(np.ndarray):
    """An array that the backend of the test below fails to evaluate."""


class UnreadableOneBlockReads(NumpyBlockStorage):
    """A one-block read returns an array its backend cannot evaluate (a device lost, say)."""

    def gather(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> NumpyArray:
        array = super().gather(layer, blocks, n_tokens)
        return array.view(_Unreadable) if len(blocks) == 1 else array


def test_a_held_read_the_backend_fails_to_evaluate_at_the_end_is_a_replay_error() -> None:
    def to_numpy(array: NumpyArray) -> npt.NDArray[np.float32]:
        if isinstance(array, _Unreadable):
            raise RuntimeError("device lost")
        return np.asarray(array, dtype=np.float32)

    backend = dataclasses.replace(numpy_variant(UnreadableOneBlockReads), to_numpy=to_numpy)
    ops = (Allocate("kv", 4, owner=1), Gather(0, (h(0, 0),), 2, hold=5), Write(0, h(0, 1), 0, 1))
    said = "at the end: evaluating a held read raised RuntimeError: device lost"
    with pytest.raises(ReplayError, match=said) as raised:
        replay(trace(*ops), backend)
    assert raised.value.op_index == 2


def test_the_replay_command_checks_reads_held_past_the_last_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = (Allocate("kv", 2, owner=1), Gather(0, (h(0, 0),), 2, hold=5), Write(0, h(0, 0), 0, 1))
    sound = replay_trace(trace(*ops), "numpy")
    assert sound[0] is Verdict.OK, sound[1]
    monkeypatch.setattr(
        reproducer, "builtin_backend", lambda _: numpy_variant(ViewReturningStorage)
    )
    verdict, message = replay_trace(trace(*ops), "numpy")
    assert verdict is Verdict.VIOLATION
    assert "at the end: the array returned by read op #1 changed after it was taken" in message


def test_replay_catches_an_mlx_read_mutated_in_place_even_when_evaluated_late() -> None:
    def make(pool: BlockPoolAllocator, spec: StoreSpec) -> CachedGatherMLXStorage:
        return CachedGatherMLXStorage(pool, spec)

    backend = dataclasses.replace(mlx_backend(), make_storage=make)
    ops = (
        Allocate("kv", 2, owner=1),
        Gather(0, (h(0, 0),), 2, hold=1),
        Write(0, h(0, 0), 0, 1),
        Sync(),
    )
    with pytest.raises(ReplayError, match="changed after it was taken") as raised:
        replay(trace(*ops), backend)
    assert raised.value.op_index == 2


def test_replay_catches_a_store_that_keeps_a_retired_tail() -> None:
    ops = (Allocate("kv", 2, owner=1), TraceLine(Shrink("kv", 0), outcome=Returned(3)))
    with pytest.raises(ReplayError, match="does not follow the pool's id_bound 1") as raised:
        replay(trace(*ops), numpy_variant(NeverShrinkingStorage))
    assert raised.value.op_index == 1


def test_replay_catches_a_write_through_a_stale_handle() -> None:
    ops = (Allocate("kv", 2, owner=1), FreeAll(1), Write(0, h(0, 0), 0, 1))
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
    lines = (
        Allocate("kv", 2, owner=1),
        Free((h(0, 0),)),
        TraceLine(Free((h(0, 0),)), outcome=Returned(None)),
    )
    save(trace(*lines), path)
    assert main([str(path), "--backend", "mlx"]) == 1
    assert "FAILED: line 4 " in capsys.readouterr().err  # the header is line 1


def test_after_a_failing_trace_the_ones_left_unreplayed_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Once silent: with several traces the replay stopped at the first failure and said
    # nothing of the ones after it.
    clean, failing, later = (tmp_path / f"{name}.jsonl" for name in ("a", "b", "c"))
    save(CANNED_TRACES["stale-handles"], clean)
    twice = TraceLine(Free((h(0, 0),)), outcome=Returned(None))  # the second free raises
    save(trace(Allocate("kv", 2, owner=1), Free((h(0, 0),)), twice), failing)
    save(CANNED_TRACES["stale-handles"], later)
    assert main([str(clean), str(failing), str(later), "--backend", "numpy"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"not replayed, after the failure above: {later}"


@pytest.mark.parametrize("on", ["spec", "pool", "numpy"])
def test_a_store_call_recorded_as_returning_that_the_store_refuses_fails_everywhere(
    on: str,
) -> None:
    # A write to layer 5 of a 1-layer store cannot return; the spec replay (and the pool
    # replay, which leaves store calls out) once passed it.
    write = Write(5, h(0, 0), 0, 2)
    verdict, why = replay_trace(
        trace(Allocate("kv", 2, owner=1), TraceLine(write, outcome=Returned(None))), on
    )
    assert verdict is Verdict.VIOLATION
    assert "a store of 1 layer(s) and blocks of 2 slots refuses its layer" in why
