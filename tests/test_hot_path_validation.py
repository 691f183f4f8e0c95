"""The per-token calls validate inline: valid arguments never reach the full validators.

``allocate``, ``free_all`` and ``mark_used`` run once per token per layer in a
decode loop, and so does a book's ``append``. Each tests exact types and ranges
inline and hands only what that test rejects to the full validators
(``resolve_stream``, ``require_int``, ``require_format``), which raise the errors. An inline test
that rejected valid values too would still give every right answer, only
slower, so no behavioural test sees it (these were the equivalent mutants
of ``mutation/SURVIVORS.md`` section 1). Here the validators are replaced by
ones that fail: every valid call, at both ends of each range, must succeed
without them, and invalid ones must still reach them.

Pure Python only: the compiled build binds these calls when it is built, so
replacing a module attribute cannot reach them there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import pytest

from veloxquant_mlx.memory import block_pool, pooled_kv_cache
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

pytestmark = pytest.mark.skipif(
    block_pool.COMPILED,
    reason="the compiled build binds its validator calls at build time; "
    "replacing them from Python cannot observe it",
)

BLOCK_SIZE = 4
VALIDATORS = ("resolve_stream", "require_int", "require_format")


class FullValidatorCalledError(Exception):
    """Raised by the stand-in validators: the inline test let this value through."""


def fail_validators(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the full validators (after the pool is built: its config uses them);
    return the list of the names of those called, in order."""
    called: list[str] = []

    def failing(name: str) -> Callable[..., object]:
        def validator(*args: object, **kwargs: object) -> object:
            called.append(name)
            raise FullValidatorCalledError(f"{name}{args}")

        return validator

    for name in VALIDATORS:
        monkeypatch.setattr(block_pool, name, failing(name))
    return called


@pytest.mark.parametrize("separate_kv", [True, False])
@pytest.mark.parametrize("n_tokens", [1, BLOCK_SIZE, BLOCK_SIZE + 1])
def test_valid_allocate_and_free_all_never_reach_the_full_validators(
    monkeypatch: pytest.MonkeyPatch, separate_kv: bool, n_tokens: int
) -> None:
    pool = BlockPoolAllocator(
        PoolConfig(block_size=BLOCK_SIZE, n_blocks=16, separate_kv=separate_kv)
    )
    called = fail_validators(monkeypatch)
    streams = ("k", "v") if separate_kv else ("k", "v", "kv")
    for stream in streams:
        pool.allocate(stream, n_tokens, 3, "int4")
    pool.free_all(3)
    assert called == []
    assert pool.stats.blocks_in_use() == 0


@pytest.mark.parametrize("n_used", [0, 1, BLOCK_SIZE - 1, BLOCK_SIZE])
def test_valid_mark_used_never_reaches_the_full_validators(
    monkeypatch: pytest.MonkeyPatch, n_used: int
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    called = fail_validators(monkeypatch)
    (block,) = pool.allocate("k", 2, 3)
    pool.mark_used(block, n_used)
    assert (called, block.n_used) == ([], n_used)


@pytest.mark.parametrize(
    ("call", "validator"),
    [
        (lambda pool: pool.allocate("x", 1, 3), "resolve_stream"),
        (lambda pool: pool.allocate("k", 0, 3), "require_int"),
        (lambda pool: pool.allocate("k", True, 3), "require_int"),
        (lambda pool: pool.allocate("k", 1, "3"), "require_int"),
        (lambda pool: pool.allocate("k", 1, 3, ""), "require_format"),
        (lambda pool: pool.free_all(3.0), "require_int"),
        (lambda pool: pool.mark_used(pool.allocate("k", 1, 3)[0], BLOCK_SIZE + 1), "require_int"),
        (lambda pool: pool.mark_used(pool.allocate("k", 1, 3)[0], -1), "require_int"),
    ],
)
def test_what_the_inline_test_rejects_still_reaches_the_full_validator(
    monkeypatch: pytest.MonkeyPatch,
    call: Callable[[BlockPoolAllocator], object],
    validator: str,
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    called = fail_validators(monkeypatch)
    with pytest.raises(FullValidatorCalledError):
        call(pool)
    assert called == [validator]


@pytest.mark.parametrize("n_tokens", [0, 1, BLOCK_SIZE + 1])
@pytest.mark.parametrize("layer", [0, 1])
def test_valid_book_appends_never_reach_the_full_validators(
    monkeypatch: pytest.MonkeyPatch, n_tokens: int, layer: int
) -> None:
    # A book's append runs once per layer per decode step and tests inline as well.
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    book = PooledKVCache(pool, n_layers=2)
    called: list[str] = []

    def failing(*args: object, **kwargs: object) -> NoReturn:
        called.append("require_int")
        raise FullValidatorCalledError(f"require_int{args}")

    monkeypatch.setattr(pooled_kv_cache, "require_int", failing)
    assert book.append(n_tokens, layer=layer) == 0
    assert (called, book.layer_offset(layer)) == ([], n_tokens)
    for bad in (-1, True):
        with pytest.raises(FullValidatorCalledError):
            book.append(bad, layer=layer)
    assert called == ["require_int"] * 2
