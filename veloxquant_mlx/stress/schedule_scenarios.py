"""The scenarios of the schedule explorer: a few threads' calls on one small pool.

Each :class:`Scenario` is two or three threads of one to three calls, after
a sequential setup, sized so that every interleaving of its scheduling
points can be run (``veloxquant_mlx.stress.schedules``). Together they cover
the races the contract must survive: two threads after the last block,
allocate against ``free_all`` of the same owner, free against shrink,
registration races, ``mark_used`` against free, growth against shrink,
``free`` against ``free_all``, and a stats read in the middle of an allocate.

Complexity and thread safety: immutable values.
"""

from __future__ import annotations

from dataclasses import dataclass

from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.operations import (
    Allocate,
    Free,
    FreeAll,
    MarkUsed,
    RegisterOwner,
    ReleaseOwner,
    Shrink,
    Stats,
)
from veloxquant_mlx_spec.table import h

__all__ = ["SCENARIOS", "Scenario"]


@dataclass(frozen=True)
class Scenario:
    """A few threads' calls on one pool, after a sequential setup.

    Calls are operations of the table. The setup's calls are labelled 0, 1,
    2... in order, so a thread names a handle the setup handed out as
    ``h(setup call, position)``: setup runs alone, so the name is the same in
    every schedule.
    """

    name: str
    config: model.SpecConfig
    threads: tuple[tuple[object, ...], ...]
    setup: tuple[object, ...] = ()
    history_len: int = 64


def _config(
    block_size: int, n_blocks: int, grow: bool = False, max_blocks: int | None = None
) -> model.SpecConfig:
    return model.SpecConfig(block_size, n_blocks, True, grow, max_blocks)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "two_threads_take_the_last_block",
        _config(4, 2),  # stream "k" holds one block
        threads=(
            (Allocate("k", 4, 1), FreeAll(1)),
            (Allocate("k", 4, 2), FreeAll(2)),
        ),
    ),
    Scenario(
        "allocate_vs_free_all_of_one_owner",
        _config(4, 8),
        setup=(Allocate("k", 4, 1),),
        threads=(
            (Allocate("k", 6, 1),),
            (FreeAll(1),),
            (RegisterOwner(1),),
        ),
    ),
    Scenario(
        "free_vs_shrink",
        _config(4, 8),
        setup=(Allocate("k", 8, 1),),
        threads=(
            (Free((h(0, 1),)), Allocate("k", 4, 2)),
            (Shrink("k", 1),),
        ),
    ),
    Scenario(
        "register_owner_race",
        _config(4, 4),
        threads=(
            (RegisterOwner(5), ReleaseOwner(5)),
            (RegisterOwner(5),),
            (Allocate("k", 4, 5), FreeAll(5)),
        ),
    ),
    Scenario(
        "mark_used_vs_free",
        _config(4, 8),
        setup=(Allocate("k", 6, 1),),  # h(0, 0) holds 4 tokens, h(0, 1) holds 2
        threads=(
            (MarkUsed(h(0, 1), 3), MarkUsed(h(0, 0), 1)),
            (Free((h(0, 1),)),),
            (Stats(),),
        ),
    ),
    Scenario(
        "growth_vs_shrink",
        _config(4, 2, grow=True, max_blocks=4),
        threads=(
            (Allocate("k", 8, 1),),
            (Allocate("k", 8, 2),),
            (Shrink("k", 0),),
        ),
    ),
    Scenario(
        "free_and_free_all_of_one_owner",
        _config(1, 4),
        setup=(Allocate("k", 2, 1),),
        threads=(
            (Free((h(0, 0),)),),
            (FreeAll(1),),
            (Free((h(0, 1),)),),
        ),
    ),
    Scenario(
        "stats_read_during_allocate",
        _config(4, 8),
        threads=(
            (Allocate("k", 6, 1),),
            (Stats(),),
        ),
    ),
)
