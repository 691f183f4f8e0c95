"""The one replay of a trace (``veloxquant-mlx replay``) judges what the trace allows.

A window of concurrent calls may be linearized in several orders that end in
different states; a later untimed line may be allowed after only some of
them, so the replay carries every end state on, as the stress checker does,
and gives a pool or store the order that the rest of the trace allows. A
pool replayed call by call (``--on pool``) is also compared in full after the
last line, where a deviation no call's outcome shows (an exhaustive
counterexample's query) is.
"""

from __future__ import annotations

import json

import pytest

from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.stress import reproducer
from veloxquant_mlx.stress.reproducer import replay_trace
from veloxquant_mlx.testing.traces import Trace, loads

HEADER = {
    "trace": "veloxquant-mlx",
    "version": 2,
    "pool": {
        "block_size": 4,
        "n_blocks": 4,
        "separate_kv": True,
        "grow_on_exhaustion": False,
        "max_blocks": None,
    },
    "history_len": 0,
}


def two_frees_then_an_allocate(returned: list[int]) -> Trace:
    """Blocks 0 and 1 freed by two overlapping calls, then one block allocated, recorded as
    ``returned``: the free that linearizes last decides which id is on top (C-LIFO)."""
    lines: list[dict[str, object]] = [
        HEADER,
        {"op": "allocate", "call": 0, "stream": "k", "n_tokens": 8, "owner": 0,
         "format": "fp16", "expect": "ok", "returned": [0, 1]},
        {"op": "free", "call": 1, "blocks": [[0, 0]], "expect": "ok", "thread": 0,
         "invoke_ns": 100, "return_ns": 300},
        {"op": "free", "call": 2, "blocks": [[0, 1]], "expect": "ok", "thread": 1,
         "invoke_ns": 150, "return_ns": 250},
        {"op": "allocate", "call": 3, "stream": "k", "n_tokens": 4, "owner": 1,
         "format": "fp16", "expect": "ok", "returned": returned},
    ]  # fmt: skip
    return loads("\n".join(json.dumps(line) for line in lines) + "\n")


@pytest.mark.parametrize("on", ["spec", "pool", "numpy"])
@pytest.mark.parametrize("top", [0, 1])
def test_a_line_after_a_window_may_need_the_order_found_second(on: str, top: int) -> None:
    # The search finds "free 0, then free 1" first; [0] is allowed only by the other order.
    verdict, message = replay_trace(two_frees_then_an_allocate([top]), on)
    assert verdict is Verdict.OK, message


def test_a_line_that_no_order_of_the_window_allows_is_a_violation_naming_it() -> None:
    verdict, message = replay_trace(two_frees_then_an_allocate([2]), "pool")
    assert verdict is Verdict.VIOLATION
    assert message.startswith("replay on pool FAILED: line 5 ")
    assert "nor in any of the 2 states the window before allows" in message


class MiscountsFreeBlocks(BlockPoolAllocator):
    """Answers ``n_free`` one too high: no call of the trace returns it."""

    def n_free(self, stream: str = "k") -> int:
        return super().n_free(stream) + 1


def test_a_pool_replayed_call_by_call_is_compared_in_full_after_the_last_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def miscounting(config: PoolConfig, history_len: int) -> BlockPoolAllocator:
        return MiscountsFreeBlocks(config, history_len=history_len)

    trace = two_frees_then_an_allocate([1])
    assert replay_trace(trace, "pool")[0] is Verdict.OK
    monkeypatch.setattr(reproducer, "default_factory", miscounting)
    verdict, message = replay_trace(trace, "pool")
    assert verdict is Verdict.VIOLATION
    assert "NFree(stream='k') returned 2; the spec predicts it returned 1" in message
