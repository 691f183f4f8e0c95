"""Paged decode attention: the fused CUDA kernel, its launch shapes, and the model hook.

The kernel itself runs only where MLX's CUDA back-end does: those tests are
skipped elsewhere (CI), with the reason. Everything around it runs anywhere:
the partitioning arithmetic, the gathered reference it is compared with,
and the hook that routes an mlx-lm model's decode attention to the cache
(on a CPU, ``attention="fused"`` reads through the table with the reference,
so the routing is checked token for token against ``KVCache``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import greedy, prompt, tiny_model

from veloxquant_mlx.memory import _paged_attention_cuda as cuda_source
from veloxquant_mlx.memory import paged_attention
from veloxquant_mlx.memory.attention_hook import (
    install_paged_attention,
    uninstall_paged_attention,
)
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.cache_storage import AUTO_PREFERS_FUSED
from veloxquant_mlx.memory.kv_cache import (
    PoolBackedKVCache,
    make_pool_backed_cache,
    resolve_attention,
)
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.paged_attention import (
    PagedKV,
    cuda_paged_decode_attention,
    cuda_unavailable_reason,
    gathered_decode_attention,
    paged_decode_attention,
    shape_unsupported_reason,
)
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.memory.prompt_cache import PoolBackedPromptCache

BLOCK_SIZE = 16
NO_CUDA = cuda_unavailable_reason()
TOLERANCE = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}
#: Largest log-probability difference between a fused decode and KVCache's (float32).
FUSED_LOGPROB_TOLERANCE = 2e-3


def _paged(
    n_q: int, n_kv: int, head_dim: int, dtype: mx.Dtype, *, n_tokens: int, seed: int
) -> tuple[mx.array, PagedKV]:
    """Random queries and slab, with a shuffled table of distinct blocks."""
    n_blocks = -(-n_tokens // BLOCK_SIZE)
    capacity = 2 * n_blocks + 3
    k_q, k_slab, k_order = mx.random.split(mx.random.key(seed), 3)
    queries = mx.random.normal((1, n_q, 1, head_dim), key=k_q).astype(dtype)
    slab = mx.random.normal((n_kv, capacity, BLOCK_SIZE, head_dim), key=k_slab).astype(dtype)
    order = mx.random.permutation(capacity, key=k_order).astype(mx.int32)
    return queries, PagedKV(slab, order[:n_blocks], order[n_blocks : 2 * n_blocks])


# -- launch shapes (pure arithmetic) ---------------------------------------------------------


@given(
    n_tokens=st.integers(1, 200_000),
    n_kv_heads=st.sampled_from([1, 2, 4, 8, 32]),
    head_dim=st.sampled_from([32, 64, 128, 256]),
    itemsize=st.sampled_from([2, 4]),
    group=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_partitions_cover_the_context_exactly(
    n_tokens: int, n_kv_heads: int, head_dim: int, itemsize: int, group: int
) -> None:
    if cuda_source.unsupported_reason(head_dim, itemsize, group) is not None:
        return
    shape = cuda_source.launch_shape(n_tokens, n_kv_heads, head_dim, itemsize, group)
    assert (shape.n_parts - 1) * shape.part_size < n_tokens <= shape.n_parts * shape.part_size
    assert shape.n_parts * n_kv_heads <= max(cuda_source.MAX_BLOCKS, n_kv_heads)
    assert shape.tpg * shape.vec == head_dim
    assert 32 % shape.tpg == 0
    assert (shape.vec * itemsize) % cuda_source.LOAD_BYTES == 0
    shared = cuda_source.shared_bytes(head_dim, group, shape.tpg, shape.warps)
    assert shared <= cuda_source.MAX_SHARED_BYTES


@pytest.mark.parametrize(
    ("head_dim", "itemsize", "group", "why"),
    [
        (96, 4, 4, "power-of-two"),
        (36, 2, 1, "multiple of 16"),
        (256, 4, 16, "registers"),
    ],
)
def test_shapes_the_kernel_cannot_serve_say_why(
    head_dim: int, itemsize: int, group: int, why: str
) -> None:
    reason = cuda_source.unsupported_reason(head_dim, itemsize, group)
    assert reason is not None and why in reason


def test_other_dtypes_and_uneven_grouping_are_not_for_the_kernel() -> None:
    assert "dtype" in str(shape_unsupported_reason(8, 2, 64, mx.int32))
    assert "multiple" in str(shape_unsupported_reason(6, 4, 64, mx.float16))
    assert shape_unsupported_reason(32, 8, 128, mx.bfloat16) is None


NVCC = shutil.which("nvcc")
STUB_HEADERS = Path(__file__).parent / "cuda_stub"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the kernel source is not compiled")
def test_the_kernel_source_compiles_for_hopper(tmp_path: Path) -> None:
    """The three kernels as MLX would assemble them (its header replaced by a stub)."""
    source = _assembled_source("float", 4, head_dim=128, group=4)
    path = tmp_path / "paged_attention.cu"
    path.write_text(source)
    result = subprocess.run(
        [
            str(NVCC),
            "-arch=sm_90",
            "-std=c++17",
            f"-I{STUB_HEADERS}",
            "-c",
            str(path),
            "-o",
            str(tmp_path / "paged_attention.o"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _assembled_source(cuda_type: str, itemsize: int, *, head_dim: int, group: int) -> str:
    """What ``mx.fast.cuda_kernel`` generates: header, signature, constants, body."""
    shape = cuda_source.launch_shape(4096, 2, head_dim, itemsize, group)
    constants = [("T", cuda_type), *shape.template(head_dim, BLOCK_SIZE, group)]
    pass_inputs = {
        "queries": cuda_type,
        "slab": cuda_type,
        "key_ids": "int32_t",
        "value_ids": "int32_t",
        "meta": "int32_t",
        "scale": "float",
    }
    kernels = [
        ("single", pass_inputs, {"out": cuda_type}, cuda_source.SINGLE_SOURCE, constants),
        (
            "split",
            pass_inputs,
            {"partial_o": "float", "partial_ml": "float"},
            cuda_source.SPLIT_SOURCE,
            constants,
        ),
        (
            "combine",
            {"partial_o": "float", "partial_ml": "float", "meta": "int32_t"},
            {"out": cuda_type},
            cuda_source.COMBINE_SOURCE,
            [("T", cuda_type), ("D", head_dim)],
        ),
    ]
    text = '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
    text += cuda_source.HEADER + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
    for name, inputs, outputs, body, template in kernels:
        assert tuple(inputs) in (cuda_source.PASS_INPUTS, cuda_source.COMBINE_INPUTS)
        params = [f"const {t}* {n}" for n, t in inputs.items()]
        params += [f"{t}* {n}" for n, t in outputs.items()]
        lines = [
            f"  using {n} = {v};" if isinstance(v, str) else f"  constexpr int {n} = {v};"
            for n, v in template
        ]
        text += f"__global__ void vq_{name}({', '.join(params)}) {{\n" + "\n".join(lines)
        text += body + "\n}\n"
    return text + "}\n"


# -- the reference ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", [1, 16, 17, 70])
def test_the_gathered_reference_is_attention_over_the_tables_positions(n_tokens: int) -> None:
    queries, paged = _paged(8, 2, 32, mx.float32, n_tokens=n_tokens, seed=n_tokens)
    got = gathered_decode_attention(queries, paged, n_tokens, scale=0.25)
    flat = paged.slab.reshape(2, -1, 32)  # (heads, capacity * block_size, dim)

    def positions(ids: mx.array) -> mx.array:
        slots = (ids[:, None] * BLOCK_SIZE + mx.arange(BLOCK_SIZE)[None]).reshape(-1)[:n_tokens]
        return mx.take(flat, slots, axis=1)[None]  # (1, heads, n, dim)

    keys = mx.repeat(positions(paged.key_ids), 4, axis=1)  # 8 query heads over 2 KV heads
    values = mx.repeat(positions(paged.value_ids), 4, axis=1)
    scores = mx.softmax((queries * 0.25) @ keys.swapaxes(-1, -2), axis=-1)
    assert mx.allclose(got, scores @ values, atol=1e-5)


# -- the kernel (GPU only) --------------------------------------------------------------------


@pytest.mark.skipif(NO_CUDA is not None, reason=f"fused kernel not run: {NO_CUDA}")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize(("n_q", "n_kv", "head_dim"), [(8, 2, 64), (8, 8, 128), (32, 4, 128)])
@pytest.mark.parametrize("n_tokens", [1, 15, 64, 65, 1000, 5000])
def test_the_fused_kernel_matches_the_gathered_path(
    dtype: mx.Dtype, n_q: int, n_kv: int, head_dim: int, n_tokens: int
) -> None:
    queries, paged = _paged(n_q, n_kv, head_dim, dtype, n_tokens=n_tokens, seed=n_tokens)
    scale = head_dim**-0.5
    fused = cuda_paged_decode_attention(queries, paged, n_tokens, scale=scale)
    upcast = PagedKV(paged.slab.astype(mx.float32), paged.key_ids, paged.value_ids)
    reference = gathered_decode_attention(queries.astype(mx.float32), upcast, n_tokens, scale=scale)
    assert fused.shape == queries.shape and fused.dtype == dtype
    diff = (fused.astype(mx.float32) - reference).reshape(-1)
    error = mx.linalg.norm(diff) / mx.linalg.norm(reference.reshape(-1))
    assert error.item() < TOLERANCE[dtype], f"relative error {error.item()}"  # type: ignore[operator]


# -- which implementation answers (any machine) ----------------------------------------------


def test_the_kernel_needs_the_cuda_back_end_then_the_gpu_as_default_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paged_attention, "_cuda_present", lambda: False)
    assert cuda_unavailable_reason() == (
        "MLX's CUDA back-end is not available here (mx.cuda.is_available() is False)"
    )
    monkeypatch.setattr(paged_attention, "_cuda_present", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert cuda_unavailable_reason() == "the default device is Device(cpu, 0), not the GPU"
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert cuda_unavailable_reason() is None


@pytest.mark.parametrize(
    ("shape", "kernel"),
    [
        ((8, 2, 64, mx.float16), True),
        ((8, 2, 96, mx.float16), False),  # a head size that is no power of two
        ((32, 2, 256, mx.float32), False),  # more registers than a thread has
    ],
    ids=["fits", "head size", "registers"],
)
def test_the_kernel_answers_where_cuda_runs_and_the_shape_fits_the_reference_elsewhere(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int, int, mx.Dtype], kernel: bool
) -> None:
    # The kernel stands in as a recorder, so the routing is checked without a GPU.
    calls: list[tuple[object, ...]] = []

    def kernel_stand_in(
        queries: mx.array, paged: PagedKV, n_tokens: int, *, scale: float
    ) -> mx.array:
        calls.append((queries, paged, n_tokens, scale))
        return gathered_decode_attention(queries, paged, n_tokens, scale=scale)

    monkeypatch.setattr(paged_attention, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(paged_attention, "cuda_paged_decode_attention", kernel_stand_in)
    queries, paged = _paged(*shape, n_tokens=20, seed=4)
    got = paged_decode_attention(queries, paged, 20, scale=0.125)
    assert mx.array_equal(got, gathered_decode_attention(queries, paged, 20, scale=0.125))
    assert calls == ([(queries, paged, 20, 0.125)] if kernel else [])


# -- routing an mlx-lm model's attention ------------------------------------------------------


def _store_for(model: object, n_blocks: int = 256) -> MLXBlockStorage:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=n_blocks))
    return MLXBlockStorage(pool, 2, 2, 16, mx.float32, lazy_writes=True)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_fused_mode_decodes_like_kv_cache_and_only_routes_its_own_caches(
    architecture: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(architecture, 3, n_layers=2, n_kv_heads=2, head_dim=16)
    store = _store_for(model)
    answered: list[bool] = []
    attend = PoolBackedKVCache.attend_in_place

    def counting(self: PoolBackedKVCache, queries: mx.array, scale: float) -> mx.array | None:
        result = attend(self, queries, scale)
        answered.append(result is not None)
        return result

    monkeypatch.setattr(PoolBackedKVCache, "attend_in_place", counting)
    try:
        with make_pool_backed_cache(model, store, attention="fused") as fused:
            assert [cache.attention for cache in fused] == ["fused", "fused"]
            our_tokens, our_logprobs = greedy(model, prompt(5), fused, 24)
        # KVCache goes through the installed hook too, and must not notice it.
        their_tokens, their_logprobs = greedy(model, prompt(5), make_prompt_cache(model), 24)
    finally:
        uninstall_paged_attention(model)
    # Every decode step of both layers was answered in place (the prefill is not asked).
    assert len(answered) >= 2 * 23 and all(answered)
    assert our_tokens == their_tokens
    # The kernel sums in another order than MLX's attention: equal within float32
    # noise amplified by the tiny model's scaled weights (exact with the reference).
    tolerance = FUSED_LOGPROB_TOLERANCE if NO_CUDA is None else 1e-5
    worst = float(mx.max(mx.abs(mx.stack(our_logprobs) - mx.stack(their_logprobs))))
    assert worst < tolerance, f"log-probabilities differ by up to {worst}"
    assert store.pool.stats.blocks_in_use() == 0


@pytest.mark.parametrize(
    "queries",
    [
        mx.ones((1, 4, 2, 16)),  # two positions: a prompt chunk, with its mask
        mx.ones((2, 4, 1, 16)),  # a batch of two
        mx.ones((1, 4, 1, 16), dtype=mx.float16),  # not the store's dtype
    ],
    ids=["chunk", "batch", "dtype"],
)
def test_attend_in_place_answers_one_decode_position_of_a_fused_cache_only(
    queries: mx.array,
) -> None:
    store = _store_for(None)
    fused, gathered = (
        PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=2), attention=mode)[0]
        for mode in ("fused", "gather")
    )
    for cache in (fused, gathered):
        cache.update_and_fetch(mx.ones((1, 2, 3, 16)), mx.ones((1, 2, 3, 16)))
    one = mx.ones((1, 4, 1, 16))
    assert fused.attend_in_place(one, 0.25) is not None
    assert gathered.attend_in_place(one, 0.25) is None  # its model reads the returned arrays
    assert fused.attend_in_place(queries, 0.25) is None
    fused.book.release()
    gathered.book.release()


def test_the_hook_is_idempotent_and_comes_out_cleanly() -> None:
    model = tiny_model("llama", 4, n_layers=2, n_kv_heads=2, head_dim=16)
    module = __import__(type(model).__module__, fromlist=["_"])
    assert install_paged_attention(model) == 1
    assert install_paged_attention(model) == 0
    assert module.scaled_dot_product_attention is not base.scaled_dot_product_attention
    assert uninstall_paged_attention(model) == 1
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_auto_gathers_unless_the_kernel_runs_and_is_preferred() -> None:
    store = _store_for(None)
    expected = "fused" if AUTO_PREFERS_FUSED and NO_CUDA is None else "gather"
    assert resolve_attention(store, "auto") == expected
    assert resolve_attention(store, "fused") == "fused"
    with pytest.raises(ValueError, match="attention must be one of"):
        resolve_attention(store, "paged")  # type: ignore[arg-type]
