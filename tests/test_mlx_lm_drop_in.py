"""Drop-in means drop-in: a pool-backed cache changes nothing mlx-lm computes.

A store sized from the model holds exactly the keys and values ``KVCache``
would (so bfloat16, float16 and float32 models decode bit for bit alike, on
the gathered attention path that these tests pin; the fused CUDA kernel
agrees within float tolerance, see test_paged_attention);
a store of another dtype refuses the model's keys instead of casting them;
``kv_bits`` is refused with a clear error where mlx-lm asks a cache to
quantize, at the prompt; and a pool-backed cache saved with its ``save()``
loads with mlx-lm's ``load_prompt_cache`` alone, in a fresh process, as
``KVCache`` layers, or paged again with ``load()``, and decodes on exactly
as the original does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from conftest import pool_unchanged
from mlx.nn.layers.base import Module
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import (
    KVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from tiny_models import Decode, greedy, prompt, tiny_model

from veloxquant_mlx.memory.block_pool import (
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolConfig,
)
from veloxquant_mlx.memory.kv_cache import PoolBackedKVCache, make_pool_backed_cache
from veloxquant_mlx.memory.mlx_lm_protocol import register_for_loading
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.model_kv_layout import (
    KVLayout,
    kv_layout,
    make_pool_backed_storage,
)

BLOCK_SIZE = 4
STEPS = 24
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _pool() -> BlockPoolAllocator:
    return BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=256))


def _assert_identical(ours: Decode, reference: Decode) -> None:
    assert ours[0] == reference[0]
    assert all(mx.array_equal(a, b) for a, b in zip(ours[1], reference[1], strict=True))


# -- sizing the store from the model ---------------------------------------------------------


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_kv_layout_reads_heads_head_dim_and_dtype_from_the_model(architecture: str) -> None:
    model = tiny_model(architecture, 1, n_layers=3, n_kv_heads=2, head_dim=8, dtype=mx.bfloat16)
    assert kv_layout(model) == KVLayout(n_layers=3, n_kv_heads=2, head_dim=8, dtype=mx.bfloat16)


def test_make_pool_backed_storage_builds_the_store_the_layout_names() -> None:
    model = tiny_model("llama", 1, n_layers=3, n_kv_heads=1, head_dim=8, dtype=mx.float16)
    pool = _pool()
    storage = make_pool_backed_storage(model, pool, lazy_writes=True)
    assert (storage.pool, storage.n_layers) == (pool, 3)
    assert (storage.slot_shape, storage.dtype) == ((1, 8), mx.float16)


def test_kv_layout_refuses_a_model_with_sliding_window_layers() -> None:
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=32,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=8,
    )
    refusal = (
        "layer 1 of the model uses RotatingKVCache; PoolBackedKVCache replaces plain KVCache "
        "layers only"
    )
    with pytest.raises(ValueError, match=f"^{refusal}$"):
        kv_layout(llama.Model(args))


class _NotCallable:
    def __init__(self) -> None:
        self.layers = [None]

    def __repr__(self) -> str:
        return "<no model>"


def test_kv_layout_refuses_what_is_not_a_model() -> None:
    with pytest.raises(
        TypeError, match=r"^model must be an mlx-lm model with a list of layers, got object$"
    ):
        kv_layout(object())
    with pytest.raises(
        TypeError,
        match=r"^model must be callable as model\(tokens, cache=\.\.\.\), got <no model>$",
    ):
        kv_layout(_NotCallable())


class _Writes:
    """A model whose layer ``i`` writes ``heads[i]`` heads of 8 (nothing where it is 0)."""

    def __init__(self, *heads: int) -> None:
        self.heads = heads
        self.layers = [None] * len(heads)

    def __call__(self, tokens: mx.array, cache: list[KVCache]) -> None:
        for layer, heads in zip(cache, self.heads, strict=True):
            if heads:
                layer.update_and_fetch(mx.zeros((1, heads, 1, 8)), mx.zeros((1, heads, 1, 8)))  # type: ignore[no-untyped-call]


SHAPE_AS = "(shape as (batch, heads, tokens, head_dim), dtype)"


@pytest.mark.parametrize(
    ("model", "wrote"),
    [
        (
            _Writes(2, 3),
            f"[((1, 2, 1, 8), 'float32'), ((1, 3, 1, 8), 'float32')] {SHAPE_AS}",
        ),
        (
            _Writes(2, 0),
            f"[((1, 2, 1, 8), 'float32')] {SHAPE_AS} and some layers wrote nothing",
        ),
    ],
    ids=["two shapes", "a layer writes nothing"],
)
def test_kv_layout_refuses_layers_that_write_other_shapes_or_nothing(
    model: _Writes, wrote: str
) -> None:
    # A store has one slot shape for every layer.
    with pytest.raises(ValueError) as refused:
        kv_layout(model)
    assert str(refused.value) == (
        "expected every layer to write keys and values of one shape and dtype; the model wrote "
        + wrote
    )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_model_decodes_bit_for_bit_like_kv_cache(dtype: mx.Dtype) -> None:
    model = tiny_model("qwen2", 2, dtype=dtype)
    tokens = prompt(3)
    reference = greedy(model, tokens, make_prompt_cache(model), STEPS)
    storage = make_pool_backed_storage(model, _pool())
    with make_pool_backed_cache(model, storage, attention="gather") as cache:
        ours = greedy(model, tokens, cache, STEPS)
    assert len(set(reference[0])) > 4, "a degenerate reference decode would prove little"
    _assert_identical(ours, reference)


def test_the_readme_float16_store_refuses_a_bfloat16_model_before_anything_changes() -> None:
    model = tiny_model("llama", 4, dtype=mx.bfloat16)
    pool = _pool()
    storage = MLXBlockStorage(pool, 2, 2, 16, dtype=mx.float16)
    with make_pool_backed_cache(model, storage, owner=9, attention="gather") as cache:
        refused = pytest.raises(TypeError, match="dtype float16, got bfloat16 and bfloat16")
        with pool_unchanged(pool, owners=[9]), refused:
            greedy(model, prompt(5), cache, 4)
        assert cache.book.empty()


# -- kv_bits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [0, 5000], ids=["quantized_kv_start=0", "default start"])
@pytest.mark.parametrize("n_prompt", [11, 2, 1])
def test_kv_bits_is_refused_at_the_prompt_before_any_block_is_taken(
    start: int, n_prompt: int
) -> None:
    # A prompt of one or two tokens reaches the cache as one-position calls only: once
    # those took blocks before to_quantized refused.
    model = tiny_model("llama", 6, head_dim=32)
    pool = _pool()
    storage = make_pool_backed_storage(model, pool)
    with make_pool_backed_cache(model, storage, owner=4, attention="gather") as cache:
        refused = pytest.raises(ValueError, match=r"kv_bits=4 cannot quantize .* float32")
        with pool_unchanged(pool, owners=[4]), refused:
            greedy(
                model,
                prompt(7, n_prompt),
                cache,
                4,
                kv_bits=4,
                kv_group_size=32,
                quantized_kv_start=start,
            )
        assert all(type(layer) is PoolBackedKVCache for layer in cache)  # none replaced
        assert cache.book.empty()
    assert pool.stats.blocks_in_use() == 0


def test_any_other_caller_is_refused_when_it_asks_the_cache_to_quantize() -> None:
    model = tiny_model("llama", 6, head_dim=32)
    storage = make_pool_backed_storage(model, _pool())
    with make_pool_backed_cache(model, storage, attention="gather") as cache:
        greedy(model, prompt(7), cache, 2)  # holds positions, far below 5000
        with pytest.raises(ValueError, match="kv_bits cannot quantize"):
            maybe_quantize_kv_cache(cache, quantized_kv_start=5000, kv_group_size=32, kv_bits=4)  # type: ignore[no-untyped-call]
        maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=32, kv_bits=None)  # type: ignore[no-untyped-call]


def test_without_kv_bits_a_generation_never_looks_for_it() -> None:
    model = tiny_model("llama", 6, head_dim=32)
    reference = greedy(model, prompt(7), make_prompt_cache(model), STEPS)
    with make_pool_backed_cache(
        model, make_pool_backed_storage(model, _pool()), attention="gather"
    ) as cache:
        _assert_identical(greedy(model, prompt(7), cache, STEPS, kv_group_size=32), reference)


# -- save_prompt_cache / load_prompt_cache ----------------------------------------------------


def _continue(model: Module, cache: Sequence[object], last: int) -> Decode:
    return greedy(model, mx.array([last]), cache, STEPS)


#: Run in a fresh interpreter: load a saved file with mlx-lm alone, save what it holds.
LOAD_WITH_MLX_LM_ALONE = """
import json
import sys
import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache
caches, metadata = load_prompt_cache(sys.argv[1], return_metadata=True)
assert not [name for name in sys.modules if name.startswith("veloxquant_mlx")]
classes = [type(cache).__name__ for cache in caches]
offsets = [cache.offset for cache in caches]
print(json.dumps({"classes": classes, "offsets": offsets, "metadata": metadata}))
arrays = {
    f"{i}.{j}": cache.state[j][..., : cache.offset, :]
    for i, cache in enumerate(caches)
    for j in range(2)
}
mx.save_safetensors(sys.argv[2], arrays)
"""


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_save_writes_a_file_mlx_lm_alone_loads_in_a_fresh_process(
    dtype: mx.Dtype, tmp_path: Path
) -> None:
    model = tiny_model("llama", 8, dtype=dtype)
    saved, echoed = tmp_path / "cache.safetensors", tmp_path / "echo.safetensors"
    with make_pool_backed_cache(
        model, make_pool_backed_storage(model, _pool()), attention="gather"
    ) as cache:
        greedy(model, prompt(9), cache, 6)
        cache.save(str(saved), {"model": "tiny llama"})
        states = [layer.state for layer in cache]
    loader = subprocess.run(
        [sys.executable, "-c", LOAD_WITH_MLX_LM_ALONE, str(saved), str(echoed)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert loader.returncode == 0, loader.stderr
    offset = states[0][2]
    assert json.loads(loader.stdout) == {
        "classes": ["KVCache", "KVCache"],
        "offsets": [offset, offset],
        "metadata": {"model": "tiny llama"},
    }
    arrays = mx.load(str(echoed))
    assert isinstance(arrays, dict)
    for index, (keys, values, _) in enumerate(states):
        assert mx.array_equal(arrays[f"{index}.0"], keys)
        assert mx.array_equal(arrays[f"{index}.1"], values)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_a_saved_cache_loads_back_and_decodes_on_identically(
    dtype: mx.Dtype, tmp_path: Path
) -> None:
    model = tiny_model("llama", 8, dtype=dtype)
    storage = make_pool_backed_storage(model, _pool())
    path = str(tmp_path / "cache.safetensors")
    with make_pool_backed_cache(model, storage, attention="gather") as original:
        tokens, _ = greedy(model, prompt(9), original, 6)
        original.save(path)
        loaded = load_prompt_cache(path)  # type: ignore[no-untyped-call]
        assert [type(layer) for layer in loaded] == [KVCache, KVCache]
        assert [layer.offset for layer in loaded] == [layer.offset for layer in original]
        with make_pool_backed_cache(model, storage, attention="gather") as paged:
            assert paged.load(path) == {}
            from_paged = _continue(model, paged, tokens[-1])
        from_loaded = _continue(model, loaded, tokens[-1])
        from_original = _continue(model, original, tokens[-1])
    _assert_identical(from_loaded, from_original)
    _assert_identical(from_paged, from_original)
    assert storage.pool.stats.blocks_in_use() == 0


def test_an_empty_pool_backed_cache_saves_and_loads_empty(tmp_path: Path) -> None:
    model = tiny_model("llama", 8)
    path = str(tmp_path / "empty.safetensors")
    with make_pool_backed_cache(
        model, make_pool_backed_storage(model, _pool()), attention="gather"
    ) as cache:
        cache.save(path)
    loaded = load_prompt_cache(path)  # type: ignore[no-untyped-call]
    assert [layer.offset for layer in loaded] == [0, 0]


def test_a_file_mlx_lm_saved_directly_loads_where_this_package_is_imported(
    tmp_path: Path,
) -> None:
    model = tiny_model("llama", 8)
    path = str(tmp_path / "direct.safetensors")
    with make_pool_backed_cache(
        model, make_pool_backed_storage(model, _pool()), attention="gather"
    ) as cache:
        greedy(model, prompt(9), cache, 3)
        save_prompt_cache(path, cache)  # names PoolBackedKVCache: the fallback loads it
        loaded = load_prompt_cache(path)  # type: ignore[no-untyped-call]
        assert [type(layer) for layer in loaded] == [KVCache, KVCache]
        assert [layer.offset for layer in loaded] == [layer.offset for layer in cache]


def test_the_fallback_name_never_replaces_one_mlx_lm_defines() -> None:
    assert vars(mlx_lm_cache)["PoolBackedKVCache"] is PoolBackedKVCache
    impostor = type("KVCache", (), {})
    register_for_loading(impostor)
    assert vars(mlx_lm_cache)["KVCache"] is KVCache


# -- copy_from and state: bad input changes nothing ----------------------------------------------


def _filled(model: Module, n_tokens: int, dtype: mx.Dtype = mx.float32) -> list[KVCache]:
    caches = make_prompt_cache(model)
    keys = mx.ones((1, 2, n_tokens, 16), dtype=dtype)
    for cache in caches:
        cache.update_and_fetch(keys, keys)
    return caches


def _kv_cache(keys: mx.array) -> KVCache:
    cache = KVCache()  # type: ignore[no-untyped-call]
    cache.update_and_fetch(keys, keys)  # type: ignore[no-untyped-call]
    return cache


BAD_COPIES = {
    "one layer too few": (lambda m: _filled(m, 3)[:1], ValueError, "one cache per layer"),
    "another dtype": (lambda m: _filled(m, 3, mx.float16), TypeError, "float32, got float16"),
    "another head count": (
        lambda m: [_kv_cache(mx.ones((1, 3, 2, 16)))] * 2,
        ValueError,
        "shape",
    ),
    "not a cache": (lambda m: [object(), object()], ValueError, "state must be"),
    "3-D arrays": (  # once read as no positions: copied nothing, refused nothing
        lambda m: [SimpleNamespace(state=(mx.ones((2, 5, 16)),) * 2)] * 2,
        ValueError,
        r"must be \(1, heads, n, head_dim\) arrays, got shapes \(2, 5, 16\)",
    ),
}


@pytest.mark.parametrize(("make_bad", "error", "message"), BAD_COPIES.values(), ids=BAD_COPIES)
def test_copy_from_refuses_bad_input_and_changes_nothing(
    make_bad: Callable[[Module], Sequence[object]], error: type[Exception], message: str
) -> None:
    model = tiny_model("llama", 10)
    pool = _pool()
    with make_pool_backed_cache(
        model, make_pool_backed_storage(model, pool), owner=3, attention="gather"
    ) as cache:
        bad = make_bad(model)
        with pool_unchanged(pool, owners=[3]), pytest.raises(error, match=message):
            cache.copy_from(bad)
        assert cache.book.empty()


def test_copy_from_fills_only_an_empty_list() -> None:
    model = tiny_model("llama", 10)
    pool = _pool()
    with make_pool_backed_cache(
        model, make_pool_backed_storage(model, pool), owner=3, attention="gather"
    ) as cache:
        cache.copy_from(_filled(model, 5))
        with pool_unchanged(pool, owners=[3]), pytest.raises(ValueError, match="holds 5"):
            cache.copy_from(_filled(model, 2))


def test_copy_from_a_pool_cannot_hold_leaves_the_list_empty() -> None:
    # The first layer fits, the second's longer state does not: the first is undone.
    model = tiny_model("llama", 10)
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=4))
    short, long = _filled(model, BLOCK_SIZE), _filled(model, 3 * BLOCK_SIZE)
    with make_pool_backed_cache(
        model, make_pool_backed_storage(model, pool), owner=3, attention="gather"
    ) as cache:
        with pytest.raises(BlockPoolExhaustedError):
            cache.copy_from([short[0], long[1]])
        assert cache.book.empty()
        assert pool.stats.blocks_in_use() == 0


def test_a_state_of_another_dtype_leaves_the_layer_as_it_was() -> None:
    model = tiny_model("llama", 10)
    pool = _pool()
    with make_pool_backed_cache(
        model, make_pool_backed_storage(model, pool), owner=3, attention="gather"
    ) as cache:
        cache.copy_from(_filled(model, 5))
        wrong = mx.ones((1, 2, 2, 16), dtype=mx.bfloat16)
        with pool_unchanged(pool, owners=[3]), pytest.raises(TypeError, match="bfloat16"):
            cache[0].state = (wrong, wrong, 2)
        assert cache[0].offset == 5


def test_from_state_is_what_load_prompt_cache_calls_and_gives_a_kv_cache() -> None:
    keys = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4)
    cache = PoolBackedKVCache.from_state((keys, keys + 1, 2))
    assert type(cache) is KVCache
    assert cache.offset == 2
    assert mx.array_equal(cache.state[0][..., :2, :], keys[..., :2, :])
    assert PoolBackedKVCache.from_state((None, None, 0)).offset == 0
