"""The decode read's three ways: slices of a run, ``mx.take``, and the CUDA kernel.

Every way of reading is checked against position-by-position takes, the
kernel only where MLX's CUDA back-end runs (skipped elsewhere, CI, with the
reason); elsewhere the store's long reads are checked to keep to ``mx.take``.
A request whose blocks run on is read by slices, and one whose blocks do not
by a gather, both decoding as ``KVCache`` does. Which rows the kernel can
copy is checked anywhere, and its source is compiled for Hopper wherever
``nvcc`` is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from store_reads import recording_reads
from tiny_models import greedy, prompt, tiny_model

from veloxquant_mlx.memory import block_gather, mlx_storage
from veloxquant_mlx.memory.block_gather import (
    GATHER_SOURCE,
    gather_by_kernel,
    gather_by_take,
    kernel_gather_unsupported_reason,
    read_by_slices,
)
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.paged_attention import cuda_unavailable_reason
from veloxquant_mlx.testing.pool_orders import hand_out_descending

NO_CUDA = cuda_unavailable_reason()
NVCC = shutil.which("nvcc")
STUB_HEADERS = Path(__file__).parent / "cuda_stub"
BLOCK_SIZE = 16


@pytest.mark.parametrize(
    ("head_dim", "dtype", "why"),
    [
        (64, mx.int32, "dtype"),
        (2, mx.float32, "8 bytes, not a multiple of 16"),
        (12, mx.float16, "24 bytes, not a multiple of 16"),
    ],
)
def test_rows_the_kernel_cannot_copy_are_named(head_dim: int, dtype: mx.Dtype, why: str) -> None:
    reason = kernel_gather_unsupported_reason(head_dim, dtype)
    assert reason is not None and why in reason


@pytest.mark.parametrize(
    ("head_dim", "dtype"), [(4, mx.float32), (64, mx.float16), (128, mx.bfloat16)]
)
def test_rows_of_whole_16_byte_words_are_for_the_kernel(head_dim: int, dtype: mx.Dtype) -> None:
    assert kernel_gather_unsupported_reason(head_dim, dtype) is None


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the kernel source is not compiled")
def test_the_kernel_source_compiles_for_hopper(tmp_path: Path) -> None:
    """The kernel as ``mx.fast.cuda_kernel`` assembles it (its header replaced by a stub)."""
    cuda_type, head_dim = "__half", 128
    constants = f"  using T = {cuda_type};\n  constexpr int D = {head_dim};\n"
    constants += f"  constexpr int BS = {BLOCK_SIZE};\n  constexpr int H = 2;\n"
    params = f"const {cuda_type}* slab, const int32_t* blocks, const int32_t* meta, "
    params += f"{cuda_type}* out"
    source = '#include "mlx/backend/cuda/device/utils.cuh"\nnamespace mlx::core::cu {\n'
    source += f"__global__ void vq_gather_blocks({params}) {{\n{constants}{GATHER_SOURCE}}}\n}}\n"
    path = tmp_path / "gather.cu"
    path.write_text(source)
    command = [str(NVCC), "-arch=sm_90", "-std=c++17", f"-I{STUB_HEADERS}", "-c", str(path)]
    result = subprocess.run(
        [*command, "-o", str(tmp_path / "gather.o")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _taken(slab: mx.array, read_blocks: mx.array, n_tokens: int) -> tuple[mx.array, mx.array]:
    """The reference: every position's row picked one by one with ``mx.take``."""
    head_dim = slab.shape[3]
    flat = slab.reshape(-1, head_dim)  # row (h * capacity + b) * BLOCK_SIZE + s
    positions = mx.arange(n_tokens, dtype=mx.int32)
    entries = read_blocks[:, :, positions // BLOCK_SIZE]  # (2, heads, n_tokens)
    rows = mx.take(flat, entries * BLOCK_SIZE + positions % BLOCK_SIZE, axis=0)
    return rows[0:1], rows[1:2]


def _read(way: str, slab: mx.array, read_blocks: mx.array, n_tokens: int) -> tuple[mx.array, ...]:
    if way == "slices":  # the blocks as _consecutive_ids lays them out
        n_blocks = read_blocks.shape[2]
        return read_by_slices(slab, (BLOCK_SIZE, (n_blocks + 3) * BLOCK_SIZE), n_tokens)
    if way == "kernel":
        return gather_by_kernel(slab, read_blocks, n_tokens, BLOCK_SIZE)
    return _by_take(slab, read_blocks, n_tokens, BLOCK_SIZE)


def _by_take(
    slab: mx.array, read_blocks: mx.array, n_tokens: int, block_size: int
) -> tuple[mx.array, mx.array]:
    """``gather_by_take`` with the sizes read off the slab: what the kernel copies."""
    _, heads, rows, head_dim = slab.shape
    sizes = {"n_kv_heads": heads, "capacity": rows // block_size, "head_dim": head_dim}
    return gather_by_take(slab, read_blocks, n_tokens, block_size=block_size, **sizes)


@pytest.mark.parametrize(
    "way",
    [
        "slices",
        "take",
        pytest.param(
            "kernel",
            marks=pytest.mark.skipif(
                NO_CUDA is not None, reason=f"gather kernel not run: {NO_CUDA}"
            ),
        ),
    ],
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize(("heads", "head_dim"), [(1, 8), (2, 64), (8, 128)])
@pytest.mark.parametrize("n_tokens", [1, 15, 16, 17, 1000])
def test_each_way_of_reading_copies_what_position_by_position_takes_copy(
    way: str, dtype: mx.Dtype, heads: int, head_dim: int, n_tokens: int
) -> None:
    n_blocks = -(-n_tokens // BLOCK_SIZE)
    capacity = 2 * n_blocks + 3
    k_slab, k_order = mx.random.split(mx.random.key(n_tokens), 2)
    slab = mx.random.normal((1, heads, capacity * BLOCK_SIZE, head_dim), key=k_slab)
    slab = slab.astype(dtype)
    ids = mx.random.permutation(capacity, key=k_order)[: 2 * n_blocks].astype(mx.int32)
    if way == "slices":
        ids = _consecutive_ids(n_blocks, capacity)
    first_entries = mx.arange(heads, dtype=mx.int32)[None, :, None] * capacity
    read_blocks = first_entries + ids.reshape(2, 1, n_blocks)  # (2, heads, n_blocks)
    keys, values = _read(way, slab, read_blocks, n_tokens)
    want_keys, want_values = _taken(slab, read_blocks, n_tokens)
    assert keys.shape == values.shape == (1, heads, n_tokens, head_dim)
    assert keys.dtype == dtype
    assert mx.array_equal(keys, want_keys).item() and mx.array_equal(values, want_values).item()


def _consecutive_ids(n_blocks: int, capacity: int) -> mx.array:
    """Keys on ids ``1 .. n_blocks``, values on the ``n_blocks`` ids after ``n_blocks + 2``."""
    keys = mx.arange(1, n_blocks + 1, dtype=mx.int32)
    values = mx.arange(n_blocks + 3, 2 * n_blocks + 3, dtype=mx.int32)
    assert 2 * n_blocks + 3 <= capacity
    return mx.concatenate([keys, values])


@pytest.mark.parametrize("head_dim", [16, 2])
@pytest.mark.parametrize("device", ["this machine", "a CUDA GPU, the kernel stood in by take"])
def test_long_decode_reads_go_through_the_kernel_only_where_it_runs_and_decode_like_kv_cache(
    monkeypatch: pytest.MonkeyPatch, head_dim: int, device: str
) -> None:
    """With the threshold lowered to 12 positions: on a CUDA GPU, rows of 64 bytes are
    read by the kernel from 12 on; rows of 8 bytes, and any row elsewhere, by take. The
    stand-in checks that choice on any machine."""
    calls: list[int] = []
    stood_in = device != "this machine"
    kernel = _by_take if stood_in else gather_by_kernel  # the stand-in copies the same

    def counting(
        slab: mx.array, read_blocks: mx.array, n_tokens: int, block_size: int
    ) -> tuple[mx.array, mx.array]:
        calls.append(n_tokens)
        return kernel(slab, read_blocks, n_tokens, block_size)

    monkeypatch.setattr(block_gather, "KERNEL_MIN_TOKENS", 12)
    monkeypatch.setattr(block_gather, "gather_by_kernel", counting)
    if stood_in:
        monkeypatch.setattr(mlx_storage, "cuda_unavailable_reason", lambda: None)
    model = tiny_model("llama", 7, n_layers=2, n_kv_heads=2, head_dim=head_dim)
    pool = hand_out_descending(BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=64)))
    store = MLXBlockStorage(pool, 2, 2, head_dim, mx.float32, lazy_writes=True)
    with make_pool_backed_cache(model, store, attention="gather") as ours:
        our_tokens, our_logprobs = greedy(model, prompt(3, length=5), ours, 16)
    their_tokens, their_logprobs = greedy(model, prompt(3, length=5), make_prompt_cache(model), 16)
    if (NO_CUDA is None or stood_in) and head_dim == 16:
        # Reads of 5..11 positions take; from 12 on, both layers' reads are the kernel's.
        assert calls and min(calls) == 12 and max(calls) >= 5 + 15
        assert sorted(calls) == [n for n in range(12, max(calls) + 1) for _ in range(2)]
    else:
        assert calls == []
    assert our_tokens == their_tokens
    pairs = zip(our_logprobs, their_logprobs, strict=True)
    assert all(mx.array_equal(ours, theirs).item() for ours, theirs in pairs)


@pytest.mark.parametrize("ids", ["running on", "descending"])
def test_a_request_is_read_by_slices_exactly_while_its_blocks_run_on(
    monkeypatch: pytest.MonkeyPatch, ids: str
) -> None:
    """Alone in a fixed pool a request's ids run on (here from key id 3 and value id
    37, another owner holding the first ones): every decode read is two slices. Where
    they descend, every read is a take. Either way each layer returns, bit for bit,
    what ``KVCache`` returns."""
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=64))  # keys 0..31
    if ids == "running on":
        pool.allocate("k", 3 * 4, owner=99)
        pool.allocate("v", 5 * 4, owner=99)
    else:
        hand_out_descending(pool)
    store = MLXBlockStorage(pool, 2, 2, 16, mx.float32, lazy_writes=True)
    theirs = [KVCache() for _ in range(2)]  # type: ignore[no-untyped-call]
    reads = recording_reads(monkeypatch)
    with make_pool_backed_cache(tiny_model("llama", 11, n_layers=2), store) as ours:
        for n_new in [7] + [1] * 12:
            for layer in range(2):
                keys, values = mx.split(mx.random.normal((2, 2, n_new, 16)), 2)
                got = ours[layer].update_and_fetch(keys, values)
                want = theirs[layer].update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
                assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
        first_ids = (ours.book.key_blocks[0].block_id, ours.book.value_blocks[0].block_id)
    assert len(reads) == 2 * 13
    if ids == "running on":
        assert set(reads) == {"slices"} and first_ids == (3, 37)
    else:
        assert set(reads) == {"take"}


def test_a_caches_state_is_copied_out_even_where_its_ids_run_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kept view would make every later write to the layer copy the whole slab, and a
    caller may keep ``state``: it is gathered, only the decode path returns slices."""
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=64))
    store = MLXBlockStorage(pool, 1, 2, 8, mx.float32, lazy_writes=True)
    model = tiny_model("llama", 3, n_layers=1, n_kv_heads=2, head_dim=8)
    with make_pool_backed_cache(model, store) as cache:
        tokens = mx.ones((1, 2, 6, 8))
        cache[0].update_and_fetch(tokens, tokens)
        reads = recording_reads(monkeypatch)
        keys, values = cache[0].state[:2]
        assert reads == ["take"]
        cache[0].update_and_fetch(tokens[:, :, :1], tokens[:, :, :1])
        assert reads == ["take", "slices"]
    assert mx.array_equal(keys, tokens).item() and mx.array_equal(values, tokens).item()


@pytest.mark.parametrize("lazy_writes", [False, True])
@pytest.mark.parametrize("held", ["evaluated", "unevaluated"])
def test_a_read_by_slices_keeps_its_values_when_its_positions_are_written_again(
    lazy_writes: bool, held: str
) -> None:
    """Slices share the slab's buffer, so no later write, of this request or of another
    one on the same slab, may write into it in place."""
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=64))
    store = MLXBlockStorage(pool, 1, 2, 8, mx.float32, lazy_writes=lazy_writes)
    model = tiny_model("llama", 3, n_layers=1, n_kv_heads=2, head_dim=8)
    with (
        make_pool_backed_cache(model, store) as cache,
        make_pool_backed_cache(model, store) as other,
    ):
        ones = mx.ones((1, 2, 6, 8))
        keys, values = cache[0].update_and_fetch(ones, ones)
        if held == "evaluated":
            mx.eval(keys, values)
        table = cache[0]._table
        assert table is not None and table.run_starts is not None  # read by slices
        cache[0].trim(2)
        rewritten = mx.full((1, 2, 2, 8), 5.0)
        new_keys, _ = cache[0].update_and_fetch(rewritten, rewritten)
        twos = mx.full((1, 2, 9, 8), 2.0)
        other[0].update_and_fetch(twos, twos)
        mx.eval(new_keys)
        assert mx.array_equal(keys, ones).item() and mx.array_equal(values, ones).item()
        assert new_keys[:, :, 4:].min().item() == 5.0
