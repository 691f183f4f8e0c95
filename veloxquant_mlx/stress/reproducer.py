"""Reproducer files of linearizability violations, and the one command that replays any file.

When a window of a stress run has no valid order, the runner writes a
reproducer: the pool's configuration, every spec state the window may have
started in (as the checker carried them, handle names included), and the
minimal failing window's calls with their times and outcomes. Checking it
again needs nothing from the run::

    python -m stress --replay RUN_DIR/violation-linearizability.json

:func:`replay_path` is that command's engine, and gives a verdict: a
reproducer is re-checked (a violation while it still fails, with the same
explanation; OK once its window is linearizable; inconclusive if the search
budget runs out first), and a trace written by
:mod:`veloxquant_mlx.stress.replay` is replayed through the aliasing replay
(:func:`~veloxquant_mlx.testing.replay_command.replay_verdict`: a partial
trace that replays clean is inconclusive, never OK).

File format: one JSON object with keys ``reproducer`` (the format name),
``version``, ``pool`` (``PoolConfig`` fields), ``history_len``,
``starts`` (spec states, see :func:`checkpoint_to_json`), ``window``
(events, see :func:`~veloxquant_mlx.stress.history.event_to_json`) and
``message``.

Complexity: O(size of the file). Thread safety: pure functions plus file I/O.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from veloxquant_mlx.commandline.bad_input import BadInputError
from veloxquant_mlx.commandline.files import atomic_write_text
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.stress.checker import Violation
from veloxquant_mlx.stress.history import Event
from veloxquant_mlx.stress.history_json import event_from_json, event_to_json
from veloxquant_mlx.stress.linearizability import DEFAULT_BUDGET, search
from veloxquant_mlx.stress.minimal import explain
from veloxquant_mlx.stress.specstep import Checkpoint
from veloxquant_mlx.testing.aliasing import builtin_backend
from veloxquant_mlx.testing.replay_command import load_checked, replay_verdict
from veloxquant_mlx_spec.model import Counters, HandleView, PoolState, SpecConfig, StatsView

__all__ = [
    "REPRODUCER_FORMAT",
    "Reproducer",
    "checkpoint_from_json",
    "checkpoint_to_json",
    "load_reproducer",
    "replay_path",
    "spec_config",
    "write_reproducer",
]

REPRODUCER_FORMAT: Final = "veloxquant-mlx-linearizability"
REPRODUCER_VERSION: Final = 1


@dataclass(frozen=True)
class Reproducer:
    """A failing window and the states it may have started in."""

    pool: PoolConfig
    history_len: int
    starts: tuple[Checkpoint, ...]
    window: tuple[Event, ...]
    message: str


def spec_config(pool: PoolConfig) -> SpecConfig:
    """The spec's twin of a ``PoolConfig``."""
    return SpecConfig(
        pool.block_size, pool.n_blocks, pool.separate_kv, pool.grow_on_exhaustion, pool.max_blocks
    )


def _pool_to_json(pool: PoolConfig) -> dict[str, object]:
    return {f.name: getattr(pool, f.name) for f in dataclasses.fields(pool)}


def checkpoint_to_json(checkpoint: Checkpoint) -> dict[str, object]:
    """A spec state and its handle names as JSON (the config is stored once, beside it)."""
    state = checkpoint.state
    return {
        "free_lists": [[stream, list(stack)] for stream, stack in state.free_lists],
        "next_block_id": state.next_block_id,
        "handles": [dataclasses.astuple(view) for view in state.handles],
        "registered": sorted(state.registered),
        "ever_allocated": sorted(state.ever_allocated),
        "retired": sorted(state.retired),
        "counters": dataclasses.asdict(state.counters),
        "history": [dataclasses.asdict(view) for view in state.history],
        "names": [list(name) for name in checkpoint.names],
    }


def checkpoint_from_json(
    record: dict[str, Any], config: SpecConfig, history_len: int
) -> Checkpoint:
    """Parse what :func:`checkpoint_to_json` wrote.

    Raises:
        KeyError, TypeError, ValueError: The record is malformed.
    """
    state = PoolState(
        config=config,
        history_len=history_len,
        free_lists=tuple((str(s), tuple(map(int, ids))) for s, ids in record["free_lists"]),
        next_block_id=int(record["next_block_id"]),
        handles=tuple(HandleView(*view) for view in record["handles"]),
        registered=frozenset(map(int, record["registered"])),
        ever_allocated=frozenset(map(int, record["ever_allocated"])),
        retired=frozenset(map(int, record["retired"])),
        counters=Counters(**record["counters"]),
        history=tuple(StatsView(**view) for view in record["history"]),
    )
    names = tuple((int(op_id), int(position)) for op_id, position in record["names"])
    return Checkpoint(state, names)


def write_reproducer(path: Path, violation: Violation, pool: PoolConfig, history_len: int) -> None:
    """Write ``violation`` (its minimal window and start states) to ``path``."""
    document = {
        "reproducer": REPRODUCER_FORMAT,
        "version": REPRODUCER_VERSION,
        "pool": _pool_to_json(pool),
        "history_len": history_len,
        "starts": [checkpoint_to_json(checkpoint) for checkpoint in violation.starts],
        "window": [event_to_json(event) for event in violation.window],
        "message": violation.message,
    }
    atomic_write_text(path, json.dumps(document, indent=1) + "\n")


def load_reproducer(path: Path) -> Reproducer:
    """Read a file written by :func:`write_reproducer`.

    Raises:
        ValueError: It is not a reproducer, or is malformed (the message says where).
    """
    document = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or document.get("reproducer") != REPRODUCER_FORMAT:
        raise ValueError(f"{path} is not a {REPRODUCER_FORMAT} reproducer")
    if document.get("version") != REPRODUCER_VERSION:
        raise ValueError(
            f"{path}: reproducer version {document.get('version')!r} is not supported; "
            f"expected {REPRODUCER_VERSION}"
        )
    try:
        pool = PoolConfig(**document["pool"])
        history_len = int(document["history_len"])
        config = spec_config(pool)
        starts = tuple(
            checkpoint_from_json(record, config, history_len) for record in document["starts"]
        )
        window = tuple(event_from_json(record) for record in document["window"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: malformed reproducer: {error!r}") from None
    return Reproducer(pool, history_len, starts, window, str(document.get("message", "")))


def recheck(
    reproducer: Reproducer, *, budget: int | None = DEFAULT_BUDGET
) -> tuple[Verdict, str]:
    """Check the reproducer's window again: its verdict and what was found.

    A violation (with the explanation) while no order fits the spec; OK once
    one does; inconclusive if the search ran out of ``budget`` first.
    """
    result = search(reproducer.starts, reproducer.window, budget=budget, first_end_only=True)
    if result.ends:
        return Verdict.OK, "the window is linearizable now"
    if not result.complete:
        return Verdict.INCONCLUSIVE, (
            f"not decided: the search budget of {budget:,} configurations ran out"
        )
    return Verdict.VIOLATION, explain(reproducer.starts, reproducer.window, budget=budget)


def _is_reproducer(path: Path) -> bool:
    with path.open(encoding="utf-8", errors="replace") as file:
        head = file.read(200)
    return f'"reproducer": "{REPRODUCER_FORMAT}"' in head


def replay_path(path: Path, backend: str = "mlx") -> tuple[Verdict, str]:
    """Replay a trace or re-check a reproducer: the verdict and a line saying it.

    Raises:
        BadInputError: The file cannot be read as either kind, or the trace
            cannot be replayed here (see ``load_checked``).
    """
    try:
        is_reproducer = _is_reproducer(path)
    except OSError as error:
        raise BadInputError(f"{path}: cannot read it: {error.strerror or error}") from None
    if is_reproducer:
        try:
            reproducer = load_reproducer(path)
        except (OSError, ValueError) as error:
            raise BadInputError(str(error)) from None
        verdict, what = recheck(reproducer)
        if verdict is Verdict.VIOLATION:
            what = f"still not linearizable: {what}"
        return verdict, f"{path}: {what}"
    storage = builtin_backend(backend)
    return replay_verdict(path, load_checked(path, storage), storage)
