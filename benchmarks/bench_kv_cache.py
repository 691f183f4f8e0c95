"""Benchmark of the pool-backed KV cache against mlx-lm's caches; prints one JSON document.

Two questions, each answered side by side in one run so that the machine's
speed cancels out (the targets come from the project's issue 5-7; nothing
here passes or fails):

- **Memory.** A mixed batch of requests (prompt lengths lognormal, decode
  lengths geometric, seeded) is prefilled and decoded token by token
  through :class:`PoolBackedKVCache` and through mlx-lm's ``KVCache``. The
  bytes each holds at the end are summed (``nbytes``, the figure mlx-lm
  reports), with the worst per-request, per-layer idle slots: ours must
  stay below ``block_size`` (the target is ``block_size - 1``), ``KVCache``
  grows in 256-token steps.
- **Decode speed.** A mid-size llama built in code (random weights) decodes
  at each context length with ours, with ``KVCache`` (one preallocated
  buffer, a slice per step), and with ``KVCache`` growing by one block at a
  time (``step = block_size``: the upstream design of a contiguous buffer
  extended by concatenation). Rounds rotate the variants and every round
  trims back to the same context; each figure is a median over rounds and
  each ratio a median of same-round ratios. Target: ours >= 0.8x ``KVCache``.

MLX's CPU backend keeps freed buffers for reuse only up to its cache limit
(32 MB by default there). A long context's per-step gathers exceed it, so
the buffers go back to the C allocator and, in a fresh process, each step
page-faults fresh memory (``page_faults_per_token``). The decode section
therefore raises the limit (``--mlx-cache-limit-mb``) for every variant;
the full run first measures the longest context at MLX's default, in the
fresh process, to show the effect.

    python benchmarks/bench_kv_cache.py            # full run, a few minutes on a CPU
    python benchmarks/bench_kv_cache.py --quick    # small and short, smoke only

Thread safety: single-threaded. Runs unchanged on Metal or CUDA (no NumPy).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.utils import tree_map
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_cache import PoolBackedPromptCache, make_pool_backed_cache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage

BLOCK_SIZE = 16
N_LAYERS = 8
HIDDEN = 512
N_HEADS = 8
N_KV_HEADS = 2
HEAD_DIM = HIDDEN // N_HEADS
INTERMEDIATE = 1408
VOCAB = 4096
SEED = 0


class ConcatPerBlockKVCache(KVCache):
    """mlx-lm's ``KVCache`` grown by one block at a time: a concatenation every block."""

    step = BLOCK_SIZE


@dataclass(frozen=True)
class Options:
    """What one run measures."""

    quick: bool
    n_requests: int
    contexts: tuple[int, ...]
    rounds: int
    steps_per_round: int
    mlx_cache_limit_mb: int


def mlx_lm_caches(cache_class: type[KVCache]) -> list[KVCache]:
    """One of mlx-lm's caches of ``cache_class`` per layer."""
    return [cache_class() for _ in range(N_LAYERS)]


# -- memory ---------------------------------------------------------------------------------


def request_lengths(n_requests: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, decode) lengths: prompts lognormal around 512, decodes geometric, mean 128."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(n_requests):
        prompt = min(8192, max(8, round(rng.lognormvariate(math.log(512), 1.0))))
        decode = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / 128))
        lengths.append((prompt, decode))
    return lengths


def _feed(cache: Sequence[Any], prompt: int, decode: int) -> None:
    """Prefill ``prompt`` positions in one update per layer, then decode one by one."""
    for n_tokens in [prompt] + [1] * decode:
        chunk = mx.zeros((1, N_KV_HEADS, n_tokens, HEAD_DIM), dtype=mx.float16)
        for layer in cache:
            layer.update_and_fetch(chunk, chunk)  # the fetch is lazy and never evaluated
    mx.eval([layer.state for layer in cache])


def bench_memory(options: Options) -> dict[str, object]:
    """Bytes held by a mixed batch with ours vs mlx-lm's ``KVCache``, all requests alive."""
    pool = BlockPoolAllocator(
        PoolConfig(block_size=BLOCK_SIZE, n_blocks=0, grow_on_exhaustion=True)
    )
    storage = MLXBlockStorage(pool, N_LAYERS, N_KV_HEADS, HEAD_DIM, mx.float16)
    model = _model(n_layers=N_LAYERS, scale=1.0)
    lengths = request_lengths(options.n_requests, SEED)
    ours: list[PoolBackedPromptCache] = []
    theirs: list[list[Any]] = []
    for owner, (prompt, decode) in enumerate(lengths):
        ours.append(make_pool_backed_cache(model, storage, owner=owner))
        theirs.append(mlx_lm_caches(KVCache))
        _feed(ours[-1], prompt, decode)
        _feed(theirs[-1], prompt, decode)
    ours_bytes = sum(layer.nbytes for cache in ours for layer in cache)
    theirs_bytes = sum(layer.nbytes for cache in theirs for layer in cache)
    slot_bytes = N_KV_HEADS * HEAD_DIM * mx.float16.size
    figures: dict[str, object] = {
        "requests": len(lengths),
        "tokens_total": sum(prompt + decode for prompt, decode in lengths),
        "prompt_lengths": [prompt for prompt, _ in lengths],
        "decode_lengths": [decode for _, decode in lengths],
        "block_size": BLOCK_SIZE,
        "layers": N_LAYERS,
        "pool_backed_bytes": ours_bytes,
        "kv_cache_bytes": theirs_bytes,
        "pool_backed_over_kv_cache": ours_bytes / theirs_bytes,
        "pool_blocks_in_use_bytes": pool.stats.blocks_in_use() * BLOCK_SIZE * slot_bytes * N_LAYERS,
        "pool_backed_max_idle_slots_per_request_per_layer": max(
            cache.book.slots_wasted() for cache in ours
        ),
        "target_max_idle_slots": BLOCK_SIZE - 1,
        "kv_cache_max_idle_slots_per_request_per_layer": max(
            cache[0].keys.shape[2] - cache[0].offset for cache in theirs
        ),
        "storage_resident_bytes": storage.resident_bytes(),
        "storage_resident_note": "slabs grow geometrically: up to 2x the blocks ever in use",
    }
    for cache in ours:
        cache.release()
    figures["blocks_in_use_after_release"] = pool.stats.blocks_in_use()
    return figures


# -- decode speed ---------------------------------------------------------------------------


def _model(n_layers: int, scale: float) -> Module:
    mx.random.seed(SEED)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=HIDDEN,
            num_hidden_layers=n_layers,
            intermediate_size=INTERMEDIATE,
            num_attention_heads=N_HEADS,
            num_key_value_heads=N_KV_HEADS,
            rms_norm_eps=1e-5,
            vocab_size=VOCAB,
        )
    )
    if scale != 1.0:
        model.update(tree_map(lambda weight: weight * scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def _fill(cache: Sequence[Any], context: int) -> None:
    """Put ``context`` random positions in every layer, as a prefill would."""
    for layer in cache:
        keys = mx.random.normal((1, N_KV_HEADS, context, HEAD_DIM))
        values = mx.random.normal((1, N_KV_HEADS, context, HEAD_DIM))
        mx.eval(layer.update_and_fetch(keys, values))


def _decode_step_figures(model: Module, cache: Sequence[Any], steps: int) -> tuple[float, float]:
    """Greedy decode ``steps`` tokens, evaluating each (as a server streams them).

    Returns:
        Tokens per second, and minor page faults per token (fresh memory touched).
    """
    token = mx.array([1])
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
    elapsed = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    return steps / elapsed, faults / steps


def bench_decode_at(
    model: Module, context: int, options: Options, variants: dict[str, Callable[[], Sequence[Any]]]
) -> dict[str, object]:
    """Median tokens/s of each variant at ``context``, and same-round ratios to ours.

    Caches are not trimmed between rounds (a trimmed ``KVCache`` would keep its
    grown buffer and never concatenate again): the context drifts up by
    ``rounds * steps_per_round`` tokens, the same for every variant.
    """
    caches = {name: make() for name, make in variants.items()}
    for cache in caches.values():
        _fill(cache, context)
    speeds: dict[str, list[float]] = {name: [] for name in caches}
    faults: dict[str, list[float]] = {name: [] for name in caches}
    names = list(caches)
    for round_index in range(options.rounds):
        rotation = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in rotation:
            speed, fault_rate = _decode_step_figures(model, caches[name], options.steps_per_round)
            speeds[name].append(speed)
            faults[name].append(fault_rate)
    for cache in caches.values():
        if isinstance(cache, PoolBackedPromptCache):
            cache.release()
    result: dict[str, object] = {
        "context": context,
        "tokens_per_s": {name: statistics.median(values) for name, values in speeds.items()},
        "page_faults_per_token": {
            name: statistics.median(values) for name, values in faults.items()
        },
    }
    for name in names:
        if name != "pool_backed":
            ratios = [
                ours / theirs
                for ours, theirs in zip(speeds["pool_backed"], speeds[name], strict=True)
            ]
            result[f"pool_backed_over_{name}"] = statistics.median(ratios)
    return result


def bench_decode(options: Options) -> dict[str, object]:
    """Decode speed at every context, ours vs ``KVCache`` vs one concatenation per block."""
    model = _model(n_layers=N_LAYERS, scale=1.0)
    n_positions = max(options.contexts) + options.rounds * options.steps_per_round

    def paged(**kw: bool) -> Callable[[], Sequence[Any]]:
        # Each pool-backed variant gets its own pool: two streams, a block to spare.
        pool = BlockPoolAllocator(
            PoolConfig(block_size=BLOCK_SIZE, n_blocks=2 * (n_positions // BLOCK_SIZE + 2))
        )
        storage = MLXBlockStorage(pool, N_LAYERS, N_KV_HEADS, HEAD_DIM, mx.float32, **kw)
        return lambda: make_pool_backed_cache(model, storage)

    variants: dict[str, Callable[[], Sequence[Any]]] = {
        "pool_backed": paged(lazy_writes=True),
        "kv_cache": lambda: mlx_lm_caches(KVCache),
        "concat_per_block": lambda: mlx_lm_caches(ConcatPerBlockKVCache),
    }
    if not options.quick:
        variants["pool_backed_eager_writes"] = paged()
    at_default_limit = None
    if not options.quick:
        # First, in a fresh process, at MLX's default cache limit.
        two = {name: variants[name] for name in ("pool_backed", "kv_cache")}
        at_default_limit = bench_decode_at(model, max(options.contexts), options, two)
    default_limit = mx.set_cache_limit(options.mlx_cache_limit_mb << 20)
    try:
        rows = []
        for context in options.contexts:
            mx.clear_cache()
            rows.append(bench_decode_at(model, context, options, variants))
    finally:
        mx.set_cache_limit(default_limit)
    figures: dict[str, object] = {
        "model": {
            "architecture": "llama",
            "layers": N_LAYERS,
            "hidden": HIDDEN,
            "heads": N_HEADS,
            "kv_heads": N_KV_HEADS,
            "intermediate": INTERMEDIATE,
            "vocab": VOCAB,
            "dtype": "float32",
        },
        "block_size": BLOCK_SIZE,
        "pool_backed_storage": "MLXBlockStorage(lazy_writes=True), head-major gather_heads",
        "mlx_cache_limit_mb": options.mlx_cache_limit_mb,
        "mlx_default_cache_limit_mb": default_limit / 2**20,
        "rounds": options.rounds,
        "steps_per_round": options.steps_per_round,
        "target_pool_backed_over_kv_cache": 0.8,
        "by_context": rows,
    }
    if at_default_limit is not None:
        figures["at_mlx_default_cache_limit"] = at_default_limit
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small and short: a smoke run")
    parser.add_argument(
        "--mlx-cache-limit-mb",
        type=int,
        default=1024,
        help="MLX buffer-cache limit during the decode section (default: 1024)",
    )
    arguments = parser.parse_args(argv)
    options = Options(
        quick=arguments.quick,
        n_requests=8 if arguments.quick else 32,
        contexts=(64, 256) if arguments.quick else (256, 1024, 4096),
        rounds=2 if arguments.quick else 7,
        steps_per_round=3 if arguments.quick else 8,
        mlx_cache_limit_mb=arguments.mlx_cache_limit_mb,
    )
    started = time.perf_counter()
    report = {
        "benchmark": "kv_cache",
        "quick": options.quick,
        "platform": {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "mlx": importlib.metadata.version("mlx"),
            "mlx_lm": importlib.metadata.version("mlx-lm"),
            "device": str(mx.default_device()),
        },
        # Decode first: how MLX's CPU allocator behaves at its default cache limit
        # depends on what the process allocated and freed before.
        "decode": bench_decode(options),
        "memory": bench_memory(options),
    }
    report["seconds"] = time.perf_counter() - started
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
