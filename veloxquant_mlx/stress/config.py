"""Options of a stress run, the operation mix, and the named profiles (smoke, nightly).

:class:`StressConfig` holds everything a run needs; :func:`profile` returns
the preset of a profile, which command-line options then override:

- ``smoke``: the CI run. 4 threads, 8,000 calls (or 60 seconds, whichever
  comes first), a small growing pool, the shortest GIL switch interval; 20-30
  seconds with its checks on a loaded 2-core machine, at most 60 + 30.
- ``nightly``: 8 threads for 10 minutes on a larger pool, the same checks,
  with a barrier every 4 calls per thread so that every window stays small
  enough (about 40 calls) to check in full as the run goes; at most 2
  minutes of checking after the last call.

Every run's wall time is at most its ``duration`` plus its ``check_budget``
(plus the step each worker has in flight when ``duration`` passes, the
window's closing observations, and the joins): checking that does not
finish in time is cut, and the run's verdict is then inconclusive, never OK.

Complexity: O(1). Thread safety: immutable values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal

from veloxquant_mlx.commandline.values import MAX_INT, shown
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.testing.traces import StoreSpec
from veloxquant_mlx_spec.table import declarations

__all__ = [
    "DEFAULT_MIX",
    "MAX_CHECK_INTERVAL",
    "MAX_WINDOW_OPS",
    "OPERATION_KINDS",
    "PROFILES",
    "AllocatorFactory",
    "OperationMix",
    "StressConfig",
    "default_allocator",
    "default_out_dir",
    "profile",
]

#: The kinds of call that go to the store, not the pool: none in a run without one.
STORE_KINDS: Final = ("write", "gather")
#: Every kind of call a worker makes, as named in the mix and the report: every call of
#: the operation table, and the store's write and gather.
OPERATION_KINDS: Final = (*(d.name for d in declarations()), *STORE_KINDS)

#: Weights of the default mix: mostly allocation and freeing, every call present. A kind
#: of the table it does not name (a call added since) gets weight 1.
_WEIGHTS: Final = {
    "allocate": 24,
    "free": 14,
    "free_all": 6,
    "shrink": 3,
    "mark_used": 12,
    "register_owner": 3,
    "release_owner": 3,
    "stats": 5,
    "prometheus": 2,
    "history": 1,
    "n_free": 4,
    "blocks_for": 5,
    "is_live": 4,
    "all_live": 2,
    "id_bound": 2,
    "check_invariants": 1,
    "write": 6,
    "gather": 6,
}
DEFAULT_MIX: Final = MappingProxyType({kind: _WEIGHTS.get(kind, 1) for kind in OPERATION_KINDS})

StorageName = Literal["mlx", "numpy", "none"]

#: The most calls per thread between two barriers. A window's search grows
#: steeply with its size: past a few dozen calls per thread it rarely
#: finishes, and the recorded calls of a huge window fill the memory first.
MAX_WINDOW_OPS: Final = 1_000
#: The longest pause between two ``check_invariants()`` calls during a run, in
#: seconds (an hour). A longer one would never check a run, and past
#: ``threading.TIMEOUT_MAX`` the checker's wait cannot even be started.
MAX_CHECK_INTERVAL: Final = 3600.0


@dataclass(frozen=True)
class OperationMix:
    """Relative weights of the kinds of call; a kind of weight 0 is never made.

    Invariant: every key is in :data:`OPERATION_KINDS`, every weight ``>= 0``,
    and a kind other than :data:`STORE_KINDS` has a positive weight.
    """

    weights: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_MIX))

    def __post_init__(self) -> None:
        unknown = sorted(set(self.weights) - set(OPERATION_KINDS))
        if unknown:
            raise ValueError(
                f"unknown operation kind(s) {unknown}; expected some of {OPERATION_KINDS}"
            )
        for kind, weight in self.weights.items():
            if type(weight) is not int or weight < 0:
                raise ValueError(f"the weight of {kind!r} must be an int >= 0, got {weight!r}")
            if weight > MAX_INT:  # the command line's bound on an int (commandline.values)
                raise _too_heavy(kind, str(weight))
        if not any(self.weights.values()):
            raise ValueError("at least one operation kind needs a positive weight")
        if not any(w for kind, w in self.weights.items() if kind not in STORE_KINDS):
            raise ValueError(  # such a run would record no call: --ops would never be reached
                f"a mix of {' and '.join(STORE_KINDS)} alone makes no call (they use the "
                "blocks the pool's calls hand out); expected a positive weight for a pool call"
            )

    @classmethod
    def parse(cls, text: str) -> OperationMix:
        """``"allocate=30,free=10,shrink=0"``: the default mix with those weights changed.

        Raises:
            ValueError: :meth:`given` refuses ``text``, or the result is invalid.
        """
        return cls({**DEFAULT_MIX, **cls.given(text)})

    @staticmethod
    def given(text: str) -> dict[str, int]:
        """The weights ``text`` names (``"allocate=30,free=10"``), unchecked kinds.

        Raises:
            ValueError: An item is not ``kind=int``, a kind is named twice, or
                there is no item.
        """
        weights: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            kind, sep, value = item.partition("=")
            digits = value.strip()
            if not sep or not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"a mix item must be kind=weight (an int >= 0), got {shown(item)}")
            if kind.strip() in weights:
                raise ValueError(f"{kind.strip()!r} is given twice in {shown(text)}; expected once")
            if len(digits.lstrip("0")) > len(str(MAX_INT)):  # int() refuses 4,300 digits on
                raise _too_heavy(kind.strip(), digits)
            weights[kind.strip()] = int(digits)
        if not weights:
            raise ValueError(f"expected kind=weight items, got {text!r}")
        return weights

    def text(self) -> str:
        """The mix in the form :meth:`parse` reads."""
        return ",".join(f"{kind}={weight}" for kind, weight in self.weights.items())


def _too_heavy(kind: str, weight: str) -> ValueError:
    return ValueError(f"the weight of {kind!r} must be at most 2**63-1, got {shown(weight)}")


#: A pool small enough that threads collide on its blocks, that grows and runs out.
SMALL_POOL: Final = PoolConfig(
    block_size=4, n_blocks=24, separate_kv=True, grow_on_exhaustion=True, max_blocks=40
)
#: A store shape small enough that replaying every call on it stays fast.
SMALL_STORE: Final = StoreSpec(n_layers=2, n_kv_heads=1, head_dim=2, dtype="float32")

AllocatorFactory = Callable[[PoolConfig, int], BlockPoolAllocator]
"""Builds the pool under test from its config and ``history_len``."""


def default_allocator(config: PoolConfig, history_len: int) -> BlockPoolAllocator:
    """The real allocator (a test passes a subclass with a planted bug instead)."""
    return BlockPoolAllocator(config, history_len=history_len)


@dataclass(frozen=True)
class StressConfig:
    """Everything one stress run needs. Stop after ``ops`` calls or ``duration`` seconds.

    Attributes:
        profile: Name shown in the report (``smoke``, ``nightly`` or ``custom``).
        threads: Worker threads sharing the pool and the store.
        ops: Stop once the worker threads made this many calls (all of them), if set.
        duration: Stop after this many seconds, if set.
        seed: Seeds every thread's choices (the interleaving is the OS's).
        pool: The shared pool's configuration.
        history_len: The pool's ``history_len`` (small: it is part of every spec state).
        mix: Relative weights of the kinds of call.
        window_ops: Calls per thread between two barriers, i.e. quiescent points, at
            most :data:`MAX_WINDOW_OPS`. The checker's cost grows steeply with a
            window's size, so keep it small.
        switch_interval: ``sys.setswitchinterval`` for the run; ``None`` leaves it.
        check_interval: Seconds between ``check_invariants()`` calls, plus one when the
            calls end; 0 disables them.
        progress_interval: Seconds between progress lines; 0 disables them.
        stall_timeout: Seconds without progress after which the run is a deadlock.
        storage: The store the workers share: ``mlx``, ``numpy`` or ``none``.
        store: Shape of that store (and of the replay's).
        replay_backend: Store the linearized history is replayed on (``none``: skip).
        search_budget: Configurations one window's linearizability search may expand
            (bounds its memory; a search that needs more makes the run inconclusive).
        check_budget: Seconds the checking may go on after the last call.
        max_queued_windows: Windows recorded but not yet checked before workers wait.
        out_dir: Where the report, trace and reproducers go (``None``: nowhere).
        allocator_factory: Builds the pool under test (tests plant bugs here).
    """

    profile: str = "custom"
    threads: int = 4
    ops: int | None = 8_000
    duration: float | None = None
    seed: int = 0
    pool: PoolConfig = SMALL_POOL
    history_len: int = 4
    mix: OperationMix = field(default_factory=OperationMix)
    window_ops: int = 24
    switch_interval: float | None = 1e-6
    check_interval: float = 0.02
    progress_interval: float = 1.0
    stall_timeout: float = 30.0
    storage: StorageName = "mlx"
    store: StoreSpec = SMALL_STORE
    replay_backend: StorageName = "mlx"
    search_budget: int = 200_000
    check_budget: float = 30.0
    max_queued_windows: int = 16
    out_dir: Path | None = None
    allocator_factory: AllocatorFactory = default_allocator

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.ops is None and self.duration is None:
            raise ValueError("a run needs a limit: ops, duration, or both")
        if self.ops is not None and self.ops < 1:
            raise ValueError(f"ops must be >= 1, got {self.ops}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration}")
        if not 1 <= self.window_ops <= MAX_WINDOW_OPS:
            raise ValueError(
                f"window_ops must be an int from 1 to {MAX_WINDOW_OPS}, got {self.window_ops}"
            )
        if self.history_len < 0:
            raise ValueError(f"history_len must be >= 0, got {self.history_len}")
        if not self.check_budget > 0:
            raise ValueError(f"check_budget must be > 0 seconds, got {self.check_budget}")
        if not 0 <= self.check_interval <= MAX_CHECK_INTERVAL:
            raise ValueError(
                f"check_interval must be from 0 to {MAX_CHECK_INTERVAL:g} seconds, "
                f"got {self.check_interval}"
            )

    def checks_off(self) -> tuple[str, ...]:
        """The checks this run was asked to leave out, each naming the option that did.

        The verdict OK means every check asked for was made on every call;
        these are named beside it, so that OK never claims more.
        """
        off = []
        if self.storage == "none":
            off.append("the threads' calls on a shared store (--storage none)")
        if self.check_interval == 0:
            off.append("check_invariants() during the run (--check-interval 0)")
        if self.replay_backend == "none":
            off.append("the replay of the linearized history on a store (--replay-backend none)")
        return tuple(off)

    def with_options(self, **changes: object) -> StressConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]  # checked by __post_init__


PROFILES: Final[Mapping[str, StressConfig]] = MappingProxyType(
    {
        "smoke": StressConfig(profile="smoke", duration=60.0),
        "nightly": StressConfig(
            profile="nightly",
            threads=8,
            ops=None,
            duration=600.0,
            pool=PoolConfig(
                block_size=4, n_blocks=48, separate_kv=True, grow_on_exhaustion=True, max_blocks=80
            ),
            window_ops=4,
            check_interval=0.1,
            progress_interval=10.0,
            stall_timeout=120.0,
            search_budget=1_000_000,
            check_budget=120.0,
        ),
    }
)


def default_out_dir(profile_name: str) -> Path:
    """``reports/stress-PROFILE-YYYYmmdd-HHMMSS``, under the current directory."""
    return Path("reports") / f"stress-{profile_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def profile(name: str) -> StressConfig:
    """The preset of profile ``name``.

    Raises:
        ValueError: No such profile.
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {name!r}") from None
