"""What a stress history records of the handles a call hands out, and how it is checked.

A call that hands out handles records, besides their block ids, what each
handle shows just after the call returned (a line's ``shows``:
``stream``, ``format``, ``n_used``, ``owner``, ``ever_allocated``). The
linearizability check and the replay of a history compare each row with
the spec's handle at the call's linearization point, so a pool that tags
blocks with the wrong format (or fill level, or owner) is a violation that
names the field, whether its history is checked during the run or replayed
later (``--on pool`` or on a store). A handle freed by a call placed after
it, before its fields were read, may show ``n_used`` 0 and no owner.
Histories written before ``shows`` existed still load and replay.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.stress.checker import check_history
from veloxquant_mlx.stress.config import StressConfig, profile
from veloxquant_mlx.stress.history import ThreadRecorder
from veloxquant_mlx.stress.recording import record_call
from veloxquant_mlx.stress.reproducer import replay_trace
from veloxquant_mlx.stress.runner import run_stress
from veloxquant_mlx.testing.traces import (
    Trace,
    TraceFormatError,
    TraceLine,
    decode_line,
    dumps,
    encode_line,
    load,
    loads,
)
from veloxquant_mlx_spec.model import SpecConfig
from veloxquant_mlx_spec.operations import Allocate, FreeAll, MakeWritable, NFree
from veloxquant_mlx_spec.table import Outcome, Raised, Returned, h

CONFIG = SpecConfig(block_size=4, n_blocks=8)
POOL = PoolConfig(block_size=4, n_blocks=8)
HISTORY_LEN = 4
#: What the one block of ``Allocate("k", 4, 1)`` shows on a sound pool.
FULL_FP16 = ("k", "fp16", 4, 1, True)


def timed(  # noqa: PLR0917 -- a timed line's fields, in the order they are read
    op_id: int,
    thread: int,
    call: object,
    start: int,
    end: int,
    outcome: Outcome,
    shows: tuple[tuple[object, ...], ...] | None = None,
) -> TraceLine:
    """A call of ``thread`` from ``start`` to ``end``, with what its handles showed."""
    return TraceLine(call, op_id, outcome, thread, start, end, shows)


# -- the check -------------------------------------------------------------------------------


def test_a_handle_that_shows_another_format_than_the_spec_is_a_violation_naming_it() -> None:
    shown = ("k", "int4", 4, 1, True)
    history = [timed(0, 0, Allocate("k", 4, 1), 0, 10, Returned((0,)), (shown,))]
    violation = check_history(CONFIG, HISTORY_LEN, history)
    assert violation is not None
    assert "h(0, 0) shows format='int4' as the call returns; the spec predicts format='fp16'" in (
        violation.message
    )


@pytest.mark.parametrize(
    ("shown", "named"),
    [
        (("v", "fp16", 4, 1, True), "stream='v'"),
        (("k", "fp16", 3, 1, True), "n_used=3"),
        (("k", "fp16", 4, 2, True), "owner=2"),
        (("k", "fp16", 4, 1, False), "ever_allocated=False"),
        # Freed shows n_used 0, or (read while the free ran) the count it had: not 3.
        (("k", "fp16", 3, None, True), "n_used=3, owner=None"),
    ],
    ids=["stream", "n_used", "owner", "ever_allocated", "freed-with-another-count"],
)
def test_every_field_a_handle_shows_is_compared(shown: tuple[object, ...], named: str) -> None:
    history = [timed(0, 0, Allocate("k", 4, 1), 0, 10, Returned((0,)), (shown,))]
    violation = check_history(CONFIG, HISTORY_LEN, history)
    assert violation is not None
    assert f"h(0, 0) shows {named}" in violation.message


def test_a_window_wrong_only_in_what_its_handles_show_is_explained_by_the_field() -> None:
    """Not by where the search got stuck, where a concurrent call's ids may differ too."""
    history = [
        timed(0, 0, Allocate("k", 4, 1), 0, 10, Returned((0,)), (("k", "int4", 4, 1, True),)),
        timed(1, 1, Allocate("k", 4, 2), 1, 11, Returned((1,)), (("k", "fp16", 4, 2, True),)),
    ]
    violation = check_history(CONFIG, HISTORY_LEN, history)
    assert violation is not None
    assert "their ids, errors and values fit the spec in some order, but not what" in (
        violation.message
    )
    assert "h(0, 0) shows format='int4'" in violation.message


def test_the_fields_the_spec_predicts_fit() -> None:
    history = [timed(0, 0, Allocate("k", 4, 1), 0, 10, Returned((0,)), (FULL_FP16,))]
    assert check_history(CONFIG, HISTORY_LEN, history) is None


@pytest.mark.parametrize(
    "freed",
    [("k", "fp16", 0, None, True), ("k", "fp16", 4, None, True)],
    ids=["freed", "read-while-the-free-ran"],  # the free stores owner, then n_used
)
def test_a_handle_freed_by_a_concurrent_free_all_before_its_fields_were_read_fits(
    freed: tuple[object, ...],
) -> None:
    """The free_all is placed after the allocate; the allocating thread then read the fields."""
    history = [
        timed(0, 0, Allocate("k", 4, 1), 0, 20, Returned((0,)), (freed,)),
        timed(1, 1, FreeAll(1), 1, 21, Returned(None)),
        timed(2, 0, NFree("k"), 30, 40, Returned(4)),  # the block is back
    ]
    assert check_history(CONFIG, HISTORY_LEN, history) is None


def test_the_handle_make_writable_returns_is_compared_under_its_own_name() -> None:
    history = [
        timed(0, 0, Allocate("k", 4, 1), 0, 10, Returned((0,)), (FULL_FP16,)),
        timed(1, 0, MakeWritable(h(0, 0)), 20, 30, Returned(0), (("k", "int8", 4, 1, True),)),
    ]
    violation = check_history(CONFIG, HISTORY_LEN, history)
    assert violation is not None
    assert "h(0, 0) shows format='int8'" in violation.message


# -- recording -------------------------------------------------------------------------------


def test_a_recorded_allocate_shows_each_handle_as_it_returned() -> None:
    pool = BlockPoolAllocator(POOL, history_len=HISTORY_LEN)
    recorder = ThreadRecorder(0, 1)
    op = Allocate("k", 5, 7, "int4")
    record_call(recorder, op, lambda: pool.allocate("k", 5, 7, "int4"))
    (line,) = recorder.take()
    assert line.outcome == Returned((0, 1))
    assert line.shows == (("k", "int4", 4, 7, True), ("k", "int4", 1, 7, True))


def test_a_call_that_hands_out_no_handle_records_no_fields() -> None:
    pool = BlockPoolAllocator(POOL, history_len=HISTORY_LEN)
    recorder = ThreadRecorder(0, 1)
    record_call(recorder, NFree("k"), lambda: pool.n_free("k"))
    record_call(recorder, Allocate("k", 99, 1), lambda: pool.allocate("k", 99, 1))  # exhausted
    assert [line.shows for line in recorder.take()] == [None, None]


# -- the trace format ------------------------------------------------------------------------


def test_shows_round_trips_through_a_trace_line() -> None:
    line = timed(3, 1, Allocate("k", 5, 1), 0, 10, Returned((0, 1)), (FULL_FP16, FULL_FP16))
    text = encode_line(line)
    assert '"shows":[["k","fp16",4,1,true],["k","fp16",4,1,true]]' in text
    assert decode_line(text) == line
    assert decode_line(text).untimed().shows == line.shows


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"expect": "BlockPoolExhaustedError"}, 'needs "expect": "ok"'),
        ({"shows": [["k", "fp16", 4, 1]]}, "must be a list of [stream, format, n_used, owner"),
        ({"shows": "k"}, "one per handle returned"),
        ({"returned": [0, 1]}, "has 1 row(s), 'returned' 2 handle(s)"),
    ],
    ids=["with-an-error", "short-row", "not-a-list", "count"],
)
def test_a_malformed_shows_is_refused_naming_the_form_expected(
    fields: dict[str, object], message: str
) -> None:
    record: dict[str, object] = {
        "op": "allocate",
        "call": 0,
        "stream": "k",
        "n_tokens": 4,
        "owner": 1,
        "expect": "ok",
        "returned": [0],
        "shows": [list(FULL_FP16)],
    }
    record.update(fields)
    if record["expect"] != "ok":
        del record["returned"]
    with pytest.raises(TraceFormatError, match="field 'shows'") as refused:
        decode_line(json.dumps(record))
    assert message in str(refused.value)


def test_a_call_that_hands_out_no_handles_has_no_shows() -> None:
    with pytest.raises(TraceFormatError, match=r"has no field\(s\) \['shows'\]"):
        decode_line('{"op": "n_free", "stream": "k", "expect": "ok", "returned": 4, "shows": []}')


# -- replaying a linearized history -----------------------------------------------------------


def _linearized(shown: tuple[object, ...] | None) -> Trace:
    """A linearized history (untimed lines) whose allocate showed ``shown`` (or nothing)."""
    shows = None if shown is None else (shown,)
    lines = (
        TraceLine(Allocate("k", 4, 1), 0, Returned((0,)), shows=shows),
        TraceLine(FreeAll(1), 1, Returned(None)),
    )
    return loads(dumps(Trace(POOL, lines=lines, history_len=HISTORY_LEN)))


@pytest.mark.parametrize("on", ["spec", "pool", "numpy"])
def test_a_linearized_history_whose_handle_shows_a_wrong_format_fails_its_replay(on: str) -> None:
    verdict, message = replay_trace(_linearized(("k", "int4", 4, 1, True)), on)
    assert verdict is Verdict.VIOLATION
    assert "h(0, 0) shows format='int4' as the call returns; the spec predicts format='fp16'" in (
        message
    )
    assert replay_trace(_linearized(FULL_FP16), on) == (
        Verdict.OK,
        f"2 ops replayed on {on}: ok",
    )


def test_a_history_written_before_shows_existed_still_replays() -> None:
    trace = _linearized(None)
    assert '"shows"' not in dumps(trace)
    assert replay_trace(trace, "pool")[0] is Verdict.OK


# -- a stress run ------------------------------------------------------------------------------


class FirstFormatOfTheOwner(BlockPoolAllocator):
    """``allocate`` to an owner that holds blocks tags the new ones with its first one's format.

    Every id, count and error is right: only the new handles' ``format`` is wrong.
    """

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        if type(owner) is int and type(format) is str and format:
            held = self.blocks_for(owner)
            if held:
                format = held[0].format  # the planted bug
        return super().allocate(stream, n_tokens, owner, format)


class FormatKeptOutsideTheLock(BlockPoolAllocator):
    """``allocate`` parks its format in the pool, yields, and reads it back: a thread that
    allocates in between tags this one's blocks with its own format. Right on one thread."""

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        if type(format) is not str or not format:
            return super().allocate(stream, n_tokens, owner, format)
        self.parked_format = format
        time.sleep(0)  # the planted window (the smoke profile switches threads often)
        return super().allocate(stream, n_tokens, owner, self.parked_format)


def _short_run(tmp_path: Path, cls: type[BlockPoolAllocator], ops: int = 2_000) -> StressConfig:
    def build(config: PoolConfig, history_len: int) -> BlockPoolAllocator:
        return cls(config, history_len=history_len)

    return profile("smoke").with_options(
        out_dir=tmp_path,
        threads=3,
        ops=ops,
        check_interval=0.0,
        storage="none",
        replay_backend="none",
        progress_interval=0.0,
        allocator_factory=build,
    )


@pytest.mark.parametrize(
    "bug", [FirstFormatOfTheOwner, FormatKeptOutsideTheLock], ids=["owner-format", "race"]
)
def test_a_pool_that_tags_new_blocks_with_the_wrong_format_fails_a_stress_run(
    tmp_path: Path, bug: type[BlockPoolAllocator]
) -> None:
    """Stopped at the first violation; ``ops`` only bounds the run."""
    report = run_stress(_short_run(tmp_path, bug, ops=20_000))
    assert report.operations < 20_000
    found = [finding for finding in report.findings if finding.kind == "linearizability"]
    assert found, report.findings
    assert "shows format=" in found[0].message
    assert "as the call returns; the spec predicts format=" in found[0].message
    assert found[0].path is not None
    assert replay_trace(load(Path(found[0].path)))[0] is Verdict.VIOLATION


def test_the_real_allocator_passes_the_same_short_run(tmp_path: Path) -> None:
    report = run_stress(_short_run(tmp_path, BlockPoolAllocator))
    assert report.ok, report.findings
    shown = [line for line in load(tmp_path / "linearized.jsonl").lines if line.shows is not None]
    assert shown  # the run recorded what its handles showed, and all of it fit


def test_an_error_line_never_carries_shows() -> None:
    line = TraceLine(Allocate("k", 99, 1), 0, Raised("BlockPoolExhaustedError"), shows=())
    assert '"shows"' not in encode_line(line)
