"""Benchmark of the pool-backed KV cache against mlx-lm's ``KVCache``; prints one JSON document.

Every figure is measured side by side in one run, so that the machine's speed
cancels out (the targets come from the project's issue 9; nothing here
passes or fails):

- **Decode speed.** A mid-size llama built in code (random weights, float32)
  decodes greedily at each context (256, 1K, 4K, 16K, 32K by default), with
  one request and with ``--concurrent`` requests at once (one thread; each
  request's token is scheduled as soon as its graph is built, and a step waits
  for the previous step's tokens, as mlx-lm's ``generate_step`` does). Variants:
  mlx-lm's ``KVCache`` (one cache list per request); ours over one fixed pool
  and store shared by the requests, with ``lazy_writes`` and gathered
  attention (``pool_backed``); the same with each request reserving the
  blocks for all its positions at its prefill (``pool_backed_reserved``,
  ``reserve_tokens``, docs/RESERVATIONS.md: requests that grow side by side
  then keep ids that run on and are read by slices, where ``pool_backed``'s
  interleave and are gathered); the same with the fused paged-attention
  kernel (``pool_backed_fused``, only where MLX's CUDA back-end runs); a
  store without ``lazy_writes`` (``pool_backed_published_writes``: every
  write evaluated and published before it returns, the thread-safe
  default); and, with ``--own-stores``, ``pool_backed_reserved`` with a pool
  and store per request (``pool_backed_reserved_own_stores``: no slab shared
  between requests; not a serving design, it measures what sharing costs).
  With several requests, two variants decode them all in one forward pass
  per step: ours as ``pool_backed_reserved`` joined by ``batch_caches`` with
  the attention hook installed, so attention reads each row's own positions
  (``pool_backed_batched``, docs/BATCHED_DECODE.md); the same without the
  hook, so attention reads the rows left-padded into one array
  (``pool_backed_batched_padded``: less host work, a copy per layer); and mlx-lm's own
  ``BatchKVCache`` made by ``KVCache.merge`` (``mlx_lm_batch_kv_cache``), the
  like-for-like reference for it.
  Rounds rotate the variants; a figure is a median over rounds, a ratio the
  median of same-round ratios. Targets: ours >= 0.9x ``KVCache`` on a GPU,
  >= 0.95x on a CPU; the concurrent aggregate >= 1x.
- **Host time per token**: microseconds spent building a step's graph (the
  Python side, before it is scheduled), per token; and, of that, the time
  inside the caches' own calls (``cache_host_us_per_token``), the part the
  cache design decides. Target: the same at 256 .. 16K (within 1.2x), i.e.
  no per-block work. Beside it, the time inside ``mx.async_eval``
  (``schedule_us_per_token``): on a GPU whose device keeps up, MLX walking
  the graph on the calling thread and launching its kernels, so every node
  of a step costs host time there too, and a token bound by the host costs
  about the sum of the two; on MLX's CPU back-end it also holds computing
  (``mx.async_eval`` waits there for work in flight).
- **Resident memory**: bytes held by the store (``resident_bytes``) beside
  the bytes ``KVCache`` holds (``nbytes``) for the same requests; and, for a
  mixed batch of 32 requests, a growing store against a fixed pool sized from
  a memory budget (``make_serving_storage``), the serving default.

MLX's CPU backend keeps freed buffers for reuse only up to its cache limit
(32 MB by default there); a long context's per-step buffers exceed it and
each step would page-fault fresh memory, so the run raises the limit
(``--mlx-cache-limit-mb``) for every variant.

    python benchmarks/bench_kv_cache.py                      # full run
    python benchmarks/bench_kv_cache.py --quick              # small and short, smoke only
    python benchmarks/bench_kv_cache.py --contexts 256 4096  # some contexts only

Progress goes to stderr, the JSON document to stdout. Thread safety:
single-threaded. Runs unchanged on Metal or CUDA (no NumPy).
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
from _report import print_report, run_benchmark, set_buffer_cache_limit
from mlx.nn.layers.base import Module
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.values import int_at_least
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.attention_hook import (
    install_paged_attention,
    uninstall_paged_attention,
)
from veloxquant_mlx.memory.batch_cache import batch_caches
from veloxquant_mlx.memory.block_table import schedule
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.model_kv_layout import kv_layout, make_serving_storage
from veloxquant_mlx.memory.paged_attention import cuda_unavailable_reason

BLOCK_SIZE = 16
N_LAYERS = 8
HIDDEN = 512
N_HEADS = 8
N_KV_HEADS = 2
HEAD_DIM = HIDDEN // N_HEADS
INTERMEDIATE = 1408
VOCAB = 4096
SEED = 0
TARGET_GPU = 0.9
#: The contexts whose host time per token must agree within 1.2x (the quick run's too).
SPREAD_CONTEXTS = (64, 256, 1024, 4096, 16384)
TARGET_CPU = 0.95

Caches = list[Any]


@dataclass(frozen=True)
class Options:
    """What one run measures."""

    quick: bool
    n_requests: int
    contexts: tuple[int, ...]
    concurrent: int
    rounds: int
    steps_per_round: int
    mlx_cache_limit_mb: int
    fused: bool
    own_stores: bool = False


@dataclass
class Variant:
    """One way to hold the KV cache: how to make a request's caches, and its store."""

    make: Callable[[], Caches]
    storage: MLXBlockStorage | None = None
    fused: bool = False
    #: Stores made one per request (``--own-stores``), counted instead of ``storage``.
    own_stores: list[MLXBlockStorage] | None = None
    #: How several requests' caches become one cache list decoded in one forward pass
    #: per step; ``None``: one pass per request.
    batch: Callable[[list[Caches]], Caches] | None = None
    #: Whether the model's attention goes through the hook (fused, or a pooled batch).
    hooked: bool = False

    def resident_bytes(self, caches: list[Caches]) -> int:
        """Bytes the variant holds for ``caches``: its stores', else the caches' buffers."""
        if self.own_stores is not None:
            return sum(store.resident_bytes() for store in self.own_stores)
        if self.storage is not None:
            return self.storage.resident_bytes()
        return kv_cache_bytes(caches)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the model --------------------------------------------------------------------------------


def make_model(n_layers: int = N_LAYERS) -> Module:
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
    mx.eval(model.parameters())
    return model


def kv_cache_list() -> Caches:
    return [KVCache() for _ in range(N_LAYERS)]  # type: ignore[no-untyped-call]


def kv_cache_bytes(caches: Sequence[Caches]) -> int:
    """Bytes mlx-lm's caches hold: their whole buffers (``BatchKVCache`` has no ``nbytes``)."""
    return sum(
        layer.keys.nbytes + layer.values.nbytes
        for cache in caches
        for layer in cache
        if layer.keys is not None
    )


def merged_kv_caches(requests: list[Caches]) -> Caches:
    """mlx-lm's batch of ``requests``: one ``BatchKVCache`` per layer (``KVCache.merge``)."""
    return [
        KVCache.merge([request[layer] for request in requests])  # type: ignore[no-untyped-call]
        for layer in range(N_LAYERS)
    ]


# -- decode speed -----------------------------------------------------------------------------


def fill(cache: Caches, context: int) -> None:
    """Put ``context`` random positions in every layer, as a prefill would."""
    for layer in cache:
        keys = mx.random.normal((1, N_KV_HEADS, context, HEAD_DIM))
        values = mx.random.normal((1, N_KV_HEADS, context, HEAD_DIM))
        mx.eval(layer.update_and_fetch(keys, values))


class CacheClock:
    """Time spent inside the caches' own calls (``update_and_fetch``, ``attend_in_place``).

    Installed per layer as instance attributes, so the model's call of a cache
    method goes through the clock; the rest of a step (the model, MLX) is not
    counted. This is the host work the cache design decides.
    """

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self, caches: Caches) -> None:
        for layer in caches:
            for name in ("update_and_fetch", "attend_in_place", "attend_rows"):
                method = getattr(layer, name, None)
                if method is not None:
                    setattr(layer, name, self._timed(method))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


class RoundFigures(NamedTuple):
    """What one decode round measured (see :func:`decode_round`)."""

    tokens_per_s: float
    host_us_per_token: float
    schedule_us_per_token: float


def decode_round(
    model: Module, requests: list[Caches], steps: int, *, rows: int = 1
) -> RoundFigures:
    """Greedy decode ``steps`` tokens for every request, pipelined as mlx-lm does it;
    ``rows`` per cache list (a batch of requests joined into one list decodes all its
    rows in one forward pass per step).

    As in ``mlx_lm.generate.generate_step``, a token is scheduled
    (``mx.async_eval``) as soon as its graph is built and the previous step's
    tokens are waited for only then, so building step ``t + 1`` overlaps the
    device running step ``t``. Each request's graph is scheduled before the
    next request's is built (a server loop does the same). A pool-backed write
    still copies its whole slab when a gather scheduled before it has not run
    yet (the README says why, and what waiting for the gather cost instead).

    Returns:
        Aggregate tokens per second; host microseconds per token spent building
        the step's graph (the Python side); and those spent inside
        ``mx.async_eval`` scheduling it. On a GPU whose device keeps up, that is
        host work (walking the graph, launching kernels); on MLX's CPU back-end,
        and on a GPU that falls behind, ``mx.async_eval`` also waits there for
        work in flight, so the figure then includes computing.
    """
    tokens = [mx.ones((rows,), dtype=mx.int32) for _ in requests]
    host = scheduling = 0.0
    previous: list[mx.array] = []
    start = time.perf_counter()
    for _ in range(steps):
        for index, cache in enumerate(requests):
            building = time.perf_counter()
            logits = model(tokens[index][:, None], cache=cache)
            tokens[index] = mx.argmax(logits[:, -1], axis=-1)
            built = time.perf_counter()
            host += built - building
            schedule(tokens[index])
            scheduling += time.perf_counter() - built
        mx.eval(previous)  # the previous step's tokens, streamed while this one runs
        previous = list(tokens)
    mx.eval(previous)
    elapsed = time.perf_counter() - start
    n_tokens = steps * len(requests) * rows
    return RoundFigures(n_tokens / elapsed, host / n_tokens * 1e6, scheduling / n_tokens * 1e6)


def make_variants(
    model: Module, n_requests: int, positions: int, *, fused: bool, own_stores: bool = False
) -> dict[str, Variant]:
    """The variants for ``n_requests`` of up to ``positions`` positions each.

    Each pool-backed variant has its own fixed pool, sized for its requests
    (two streams, a spare block each), and its own store covering it; with
    ``own_stores`` one more variant gives each request a pool and store of its own.
    """

    def paged(requests: int = n_requests, **store_options: bool) -> MLXBlockStorage:
        n_blocks = 2 * requests * (positions // BLOCK_SIZE + 2)
        pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=n_blocks))
        return MLXBlockStorage(pool, N_LAYERS, N_KV_HEADS, HEAD_DIM, mx.float32, **store_options)

    def reserved(store: MLXBlockStorage, **batching: Any) -> Variant:
        """Requests over ``store`` that reserve every position (``batching``: how the
        variant joins them, and whether attention goes through the hook)."""
        return Variant(
            lambda: make_pool_backed_cache(
                model, store, attention="gather", reserve_tokens=positions
            ),
            store,
            **batching,
        )

    lazy, eager, reserving = paged(lazy_writes=True), paged(), paged(lazy_writes=True)
    variants = {
        "kv_cache": Variant(kv_cache_list),
        "pool_backed": Variant(
            lambda: make_pool_backed_cache(model, lazy, attention="gather"), lazy
        ),
        "pool_backed_reserved": reserved(reserving),
        "pool_backed_published_writes": Variant(
            lambda: make_pool_backed_cache(model, eager, attention="gather"), eager
        ),
    }
    if own_stores:
        variants["pool_backed_reserved_own_stores"] = own_stores_variant(model, positions, paged)
    if n_requests > 1:
        joined: Any = batch_caches  # joins PoolBackedPromptCache lists, a kind of Caches
        batched = reserved(paged(lazy_writes=True), batch=joined, hooked=True)
        variants["pool_backed_batched"] = batched
        variants["pool_backed_batched_padded"] = reserved(paged(lazy_writes=True), batch=joined)
        variants["mlx_lm_batch_kv_cache"] = Variant(kv_cache_list, batch=merged_kv_caches)
    if fused and cuda_unavailable_reason() is None:
        fused_store = paged(lazy_writes=True)
        variants["pool_backed_fused"] = Variant(
            lambda: make_pool_backed_cache(model, fused_store, attention="fused"),
            fused_store,
            fused=True,
            hooked=True,
        )
    return variants


def own_stores_variant(
    model: Module, positions: int, paged: Callable[..., MLXBlockStorage]
) -> Variant:
    """``pool_backed_reserved`` with a pool and store per request: no slab is shared
    between requests, so no request's write waits on (or copies for) another's read.
    Not a serving design (memory is split per request); it measures what sharing a
    slab costs (issue 9, four requests at 32K)."""
    stores: list[MLXBlockStorage] = []

    def make() -> Caches:
        stores.append(paged(1, lazy_writes=True))
        return make_pool_backed_cache(
            model, stores[-1], attention="gather", reserve_tokens=positions
        )

    return Variant(make, own_stores=stores)


def fill_and_join(
    variants: dict[str, Variant],
    requests: dict[str, list[Caches]],
    clocks: dict[str, CacheClock],
    context: int,
) -> dict[str, Caches]:
    """Prefill every request; join the requests of batched variants into their batch
    (mlx-lm's merge copies the buffers: only its batch is kept); install the clocks on
    what the model will call. Returns the batches by variant name."""
    batches: dict[str, Caches] = {}
    for name, caches in requests.items():
        for cache in caches:
            fill(cache, context)
        join = variants[name].batch
        if join is not None:
            batches[name] = join(caches)
        for cache in [batches[name]] if name in batches else caches:
            clocks[name].install(cache)
    if "mlx_lm_batch_kv_cache" in requests:
        requests["mlx_lm_batch_kv_cache"] = [batches["mlx_lm_batch_kv_cache"]]
    return batches


def bench_decode_at(
    model: Module, context: int, n_requests: int, options: Options
) -> dict[str, object]:
    """Tokens/s, host time and resident bytes of every variant at ``context``."""
    positions = context + options.rounds * options.steps_per_round + 1
    variants = make_variants(
        model, n_requests, positions, fused=options.fused, own_stores=options.own_stores
    )
    requests = {
        name: [variant.make() for _ in range(n_requests)] for name, variant in variants.items()
    }
    clocks = {name: CacheClock() for name in variants}
    batches = fill_and_join(variants, requests, clocks, context)
    uninstall_paged_attention(model)
    speeds: dict[str, list[float]] = {name: [] for name in variants}
    hosts: dict[str, list[float]] = {name: [] for name in variants}
    schedules: dict[str, list[float]] = {name: [] for name in variants}
    cache_hosts: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(options.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if variants[name].hooked:
                install_paged_attention(model)
            clocks[name].seconds = 0.0
            caches, rows = ([batches[name]], n_requests) if name in batches else (requests[name], 1)
            speed, host, scheduling = decode_round(
                model, caches, options.steps_per_round, rows=rows
            )
            uninstall_paged_attention(model)
            speeds[name].append(speed)
            hosts[name].append(host)
            schedules[name].append(scheduling)
            n_tokens = options.steps_per_round * n_requests
            cache_hosts[name].append(clocks[name].seconds / n_tokens * 1e6)
    row: dict[str, object] = {
        "context": context,
        "requests": n_requests,
        "tokens_per_s": {name: statistics.median(values) for name, values in speeds.items()},
        "host_us_per_token": {name: statistics.median(values) for name, values in hosts.items()},
        "cache_host_us_per_token": {
            name: statistics.median(values) for name, values in cache_hosts.items()
        },
        "schedule_us_per_token": {
            name: statistics.median(values) for name, values in schedules.items()
        },
        "resident_bytes": {
            name: variant.resident_bytes(requests[name]) for name, variant in variants.items()
        },
    }
    for name in names[1:]:
        row[f"{name}_over_kv_cache"] = same_round_ratio(speeds[name], speeds["kv_cache"])
    if "pool_backed_batched" in speeds:
        row["pool_backed_batched_over_mlx_lm_batch_kv_cache"] = same_round_ratio(
            speeds["pool_backed_batched"], speeds["mlx_lm_batch_kv_cache"]
        )
    for caches in requests.values():
        for cache in caches:
            if hasattr(cache, "release"):
                cache.release()
    return row


def bench_decode(options: Options) -> dict[str, object]:
    model = make_model()
    default_limit = set_buffer_cache_limit(options.mlx_cache_limit_mb << 20)
    rows = []
    try:
        for n_requests in sorted({1, options.concurrent}):
            for context in options.contexts:
                mx.clear_cache()
                started = time.perf_counter()
                row = bench_decode_at(model, context, n_requests, options)
                rows.append(row)
                speeds = row["tokens_per_s"]
                assert isinstance(speeds, dict)
                figures = ", ".join(f"{name} {speed:.0f}" for name, speed in speeds.items())
                progress(
                    f"decode: {n_requests} request(s) at {context}: {figures} tokens/s "
                    f"({time.perf_counter() - started:.0f} s)"
                )
    finally:
        mx.set_cache_limit(default_limit)
    on_gpu = mx.default_device() == mx.gpu
    return {
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
        "fused_kernel": cuda_unavailable_reason() or "available",
        "mlx_cache_limit_mb": options.mlx_cache_limit_mb,
        "rounds": options.rounds,
        "steps_per_round": options.steps_per_round,
        "target_pool_backed_over_kv_cache": TARGET_GPU if on_gpu else TARGET_CPU,
        "by_context": rows,
        "host_us_per_token_spread": host_spread(rows, "host_us_per_token"),
        "cache_host_us_per_token_spread": host_spread(rows, "cache_host_us_per_token"),
    }


def same_round_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over rounds of ``ours / theirs`` measured in the same round."""
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def host_spread(rows: list[dict[str, object]], key: str) -> dict[str, float]:
    """Per variant, the largest over the smallest single-request ``key`` (a host time
    per token) across the contexts of ``SPREAD_CONTEXTS`` that were run."""
    single: list[dict[str, float]] = [
        row[key]  # type: ignore[misc]  # built as dict[str, float] above
        for row in rows
        if row["requests"] == 1 and row["context"] in SPREAD_CONTEXTS
    ]
    names = single[0].keys() if single else ()
    return {
        name: max(host[name] for host in single) / min(host[name] for host in single)
        for name in names
    }


# -- memory -----------------------------------------------------------------------------------


def request_lengths(n_requests: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, decode) lengths: prompts lognormal around 512, decodes geometric, mean 128."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(n_requests):
        prompt = min(8192, max(8, round(rng.lognormvariate(math.log(512), 1.0))))
        decode = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / 128))
        lengths.append((prompt, decode))
    return lengths


def feed(cache: Caches, prompt: int, decode: int) -> None:
    """Prefill ``prompt`` positions in one update per layer, then decode one by one."""
    for n_tokens in [prompt] + [1] * decode:
        chunk = mx.zeros((1, N_KV_HEADS, n_tokens, HEAD_DIM))
        for layer in cache:
            layer.update_and_fetch(chunk, chunk)  # the fetch is lazy and never evaluated
    mx.eval([layer.state for layer in cache])


def bench_memory(options: Options) -> dict[str, object]:
    """Bytes held by a mixed batch: growing store and fixed pool vs mlx-lm's ``KVCache``."""
    model = make_model()
    lengths = request_lengths(options.n_requests, SEED)
    growing_pool = BlockPoolAllocator(
        PoolConfig(block_size=BLOCK_SIZE, n_blocks=0, grow_on_exhaustion=True)
    )
    growing = MLXBlockStorage(growing_pool, N_LAYERS, N_KV_HEADS, HEAD_DIM, mx.float32)
    block_bytes = kv_layout(model).block_bytes(BLOCK_SIZE)
    blocks_needed = sum(2 * -(-(prompt + decode) // BLOCK_SIZE) for prompt, decode in lengths)
    # The budget a server would set for this batch: what it needs, plus 5% headroom.
    budget = math.ceil(blocks_needed * 1.05) * block_bytes
    fixed = make_serving_storage(model, budget, block_size=BLOCK_SIZE)
    ours: dict[str, list[Any]] = {"growing": [], "fixed": []}
    theirs: list[Caches] = []
    for owner, (prompt, decode) in enumerate(lengths):
        for name, store in (("growing", growing), ("fixed", fixed)):
            ours[name].append(make_pool_backed_cache(model, store, owner=owner, attention="gather"))
            feed(ours[name][-1], prompt, decode)
        theirs.append(kv_cache_list())
        feed(theirs[-1], prompt, decode)
    in_use = growing_pool.stats.blocks_in_use() * block_bytes
    theirs_bytes = kv_cache_bytes(theirs)
    figures: dict[str, object] = {
        "requests": len(lengths),
        "tokens_total": sum(prompt + decode for prompt, decode in lengths),
        "block_size": BLOCK_SIZE,
        "layers": N_LAYERS,
        "dtype": "float32",
        "blocks_in_use_bytes": in_use,
        "kv_cache_bytes": theirs_bytes,
        "growing_store_resident_bytes": growing.resident_bytes(),
        "growing_store_resident_over_in_use": growing.resident_bytes() / in_use,
        "fixed_pool_budget_bytes": budget,
        "fixed_pool_resident_bytes": fixed.resident_bytes(),
        "fixed_pool_resident_over_in_use": fixed.resident_bytes() / in_use,
        "fixed_pool_resident_over_kv_cache": fixed.resident_bytes() / theirs_bytes,
        "pool_backed_max_idle_slots_per_request_per_layer": max(
            cache.book.slots_wasted() for cache in ours["fixed"]
        ),
        "kv_cache_max_idle_slots_per_request_per_layer": max(
            cache[0].keys.shape[2] - cache[0].offset for cache in theirs
        ),
    }
    for caches in ours.values():
        for cache in caches:
            cache.release()
    figures["blocks_in_use_after_release"] = growing_pool.stats.blocks_in_use()
    return figures


# -- the run ----------------------------------------------------------------------------------


#: The options whose values size the pool: what a refusal for memory names.
SIZE_OPTIONS = "--contexts or --concurrent"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small and short: a smoke run")
    parser.add_argument(
        "--contexts", type=int_at_least(1), nargs="+", help="context lengths to decode at"
    )
    parser.add_argument(
        "--concurrent",
        type=int_at_least(1),
        default=4,
        help="requests decoded at once (default: 4)",
    )
    parser.add_argument(
        "--rounds", type=int_at_least(1), help="rounds per context (default: 5; quick: 2)"
    )
    parser.add_argument(
        "--steps", type=int_at_least(1), help="tokens per round (default: 16; quick: 3)"
    )
    parser.add_argument(
        "--mlx-cache-limit-mb",
        type=int_at_least(0),
        default=4096,
        help="MLX buffer-cache limit during the decode section (default: 4096)",
    )
    parser.add_argument("--skip-memory", action="store_true", help="leave out the memory section")
    parser.add_argument(
        "--no-fused", action="store_true", help="leave out the fused-kernel variant"
    )
    parser.add_argument(
        "--own-stores",
        action="store_true",
        help="add a variant that gives each request a pool and store of its own (what "
        "sharing one slab between requests costs; not a serving design)",
    )
    arguments = parser.parse_args(argv)
    quick = arguments.quick
    options = Options(
        quick=quick,
        n_requests=8 if quick else 32,
        contexts=tuple(
            arguments.contexts or ((64, 256) if quick else (256, 1024, 4096, 16384, 32768))
        ),
        concurrent=arguments.concurrent,
        rounds=arguments.rounds if arguments.rounds is not None else (2 if quick else 5),
        steps_per_round=arguments.steps if arguments.steps is not None else (3 if quick else 16),
        mlx_cache_limit_mb=arguments.mlx_cache_limit_mb,
        fused=not arguments.no_fused,
        own_stores=arguments.own_stores,
    )
    started = time.perf_counter()
    figures: dict[str, object] = {"quick": options.quick, "decode": bench_decode(options)}
    if not arguments.skip_memory:
        figures["memory"] = bench_memory(options)
    figures["seconds"] = time.perf_counter() - started
    print_report("kv_cache", figures)
    return 0


if __name__ == "__main__":
    sys.exit(run_benchmark("bench_kv_cache.py", main, SIZE_OPTIONS))
