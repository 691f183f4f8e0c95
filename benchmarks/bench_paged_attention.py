"""The fused paged-attention kernel against the gathered path: correctness, then speed.

Run on a machine where MLX's CUDA back-end works (elsewhere it checks nothing,
says why, and exits 3: inconclusive). Prints a table and one JSON document
(``--json PATH``).

1. **Correctness.** For every dtype (float32, float16, bfloat16), head
   dimension (64, 128), head grouping (8/2, 8/8, 32/4 query/KV heads) and a
   spread of contexts (1 .. 32K, across block and partition edges), random
   keys and values sit in a slab behind a shuffled block table, and the
   kernel's output is compared with the reference computed in float32 from
   the same slab (a gather, then ``mx.fast.scaled_dot_product_attention``):
   ``|out - ref| / |ref|`` must stay under the dtype's tolerance; NaN never
   passes. Fresh random inputs for every case.
2. **Speed.** At each context, one layer's decode attention through the
   kernel and through the gathered path (take + MLX's attention), for the
   benchmark model's shape and for a larger one: host microseconds to build
   the call, and wall microseconds per call with 64 calls evaluated at once.

    python benchmarks/bench_paged_attention.py [--quick] [--json PATH]

Exit status (``commandline.verdicts``): 0 when every case passed, 1 if a case
failed, 2 on bad input, 3 when there is no CUDA back-end to check the kernel
on. Thread safety: single-threaded.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from _accuracy import relative_error

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.verdicts import ExitStatus
from veloxquant_mlx.memory.paged_attention import (
    PagedKV,
    cuda_paged_decode_attention,
    cuda_unavailable_reason,
    gathered_decode_attention,
    shape_unsupported_reason,
)

TOLERANCE = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
HEADS = ((8, 2), (8, 8), (32, 4))
HEAD_DIMS = (64, 128)
CONTEXTS = (1, 5, 16, 17, 63, 64, 65, 200, 1000, 4099)
SPEED_CONTEXTS = (256, 1024, 4096, 16384, 32768)
SPEED_SHAPES = {"bench_model_f32": (8, 2, 64, mx.float32), "llama8b_f16": (32, 8, 128, mx.float16)}
BLOCK_SIZE = 16

Attention = Callable[..., mx.array]


def paged_case(
    n_q: int, n_kv: int, head_dim: int, dtype: mx.Dtype, *, n_tokens: int, seed: int
) -> tuple[mx.array, PagedKV]:
    """Random queries and slab, and a shuffled table of distinct blocks inside the slab."""
    n_blocks = -(-n_tokens // BLOCK_SIZE)
    capacity = 2 * n_blocks + 3
    key = mx.random.key(seed)
    k_q, k_slab, k_perm = mx.random.split(key, 3)
    queries = mx.random.normal((1, n_q, 1, head_dim), key=k_q).astype(dtype)
    slab = mx.random.normal((n_kv, capacity, BLOCK_SIZE, head_dim), key=k_slab).astype(dtype)
    order = mx.random.permutation(capacity, key=k_perm).astype(mx.int32)
    key_ids, value_ids = order[:n_blocks], order[n_blocks : 2 * n_blocks]
    mx.eval(queries, slab, key_ids, value_ids)
    return queries, PagedKV(slab, key_ids, value_ids)


def check_correctness(quick: bool) -> list[dict[str, object]]:
    """Every case, kernel against the float32 gathered reference."""
    results = []
    seed = 0
    contexts = CONTEXTS[::3] if quick else (*CONTEXTS, 32768)
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for n_q, n_kv in HEADS:
                for n_tokens in contexts:
                    seed += 1
                    results.append(
                        one_case(n_q, n_kv, head_dim, dtype, n_tokens=n_tokens, seed=seed)
                    )
    return results


def one_case(
    n_q: int, n_kv: int, head_dim: int, dtype: mx.Dtype, *, n_tokens: int, seed: int
) -> dict[str, object]:
    case: dict[str, object] = {
        "dtype": str(dtype).rpartition(".")[2],
        "n_q": n_q,
        "n_kv": n_kv,
        "head_dim": head_dim,
        "n_tokens": n_tokens,
    }
    reason = shape_unsupported_reason(n_q, n_kv, head_dim, dtype)
    if reason is not None:
        return {**case, "ok": True, "skipped": reason}
    queries, paged = paged_case(n_q, n_kv, head_dim, dtype, n_tokens=n_tokens, seed=seed)
    scale = head_dim**-0.5
    upcast = PagedKV(paged.slab.astype(mx.float32), paged.key_ids, paged.value_ids)
    ref = gathered_decode_attention(queries.astype(mx.float32), upcast, n_tokens, scale=scale)
    try:
        out = cuda_paged_decode_attention(queries, paged, n_tokens, scale=scale)
        mx.eval(out, ref)
    except Exception as error:  # a compile or launch failure is this case's result
        return {**case, "ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
    error_value = relative_error(out, ref)
    ok = not math.isnan(error_value) and error_value < TOLERANCE[dtype]
    return {**case, "ok": ok, "relative_error": error_value, "shape_ok": out.shape == queries.shape}


def time_attention(
    attention: Attention, shape: tuple[int, int, int, mx.Dtype], n_tokens: int
) -> tuple[float, float]:
    """(host µs to build one call, wall µs per call with 64 calls per evaluation)."""
    n_q, n_kv, head_dim, dtype = shape
    queries, paged = paged_case(n_q, n_kv, head_dim, dtype, n_tokens=n_tokens, seed=7)
    scale = head_dim**-0.5
    batch = 64
    mx.eval(attention(queries, paged, n_tokens, scale=scale))  # compile, warm up
    hosts, walls = [], []
    for _ in range(7):
        start = time.perf_counter()
        outs = [attention(queries, paged, n_tokens, scale=scale) for _ in range(batch)]
        built = time.perf_counter()
        mx.eval(outs)
        done = time.perf_counter()
        hosts.append((built - start) / batch * 1e6)
        walls.append((done - start) / batch * 1e6)
    return statistics.median(hosts), statistics.median(walls)


def check_speed(quick: bool) -> list[dict[str, object]]:
    rows = []
    for name, shape in SPEED_SHAPES.items():
        for n_tokens in SPEED_CONTEXTS[:2] if quick else SPEED_CONTEXTS:
            fused_host, fused_wall = time_attention(cuda_paged_decode_attention, shape, n_tokens)
            gather_host, gather_wall = time_attention(gathered_decode_attention, shape, n_tokens)
            rows.append(
                {
                    "shape": name,
                    "n_tokens": n_tokens,
                    "fused_host_us": fused_host,
                    "fused_wall_us": fused_wall,
                    "gathered_host_us": gather_host,
                    "gathered_wall_us": gather_wall,
                    "gathered_over_fused_wall": gather_wall / fused_wall,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--json", help="write the full results to this file")
    arguments = parser.parse_args(argv)
    if arguments.json is not None:
        target = Path(arguments.json)
        if not arguments.json.strip() or target.is_dir() or not target.parent.is_dir():
            parser.error(f"--json {arguments.json!r}: expected a file path in an existing folder")
    reason = cuda_unavailable_reason()
    report: dict[str, object] = {"device": str(mx.default_device()), "cuda": reason or "available"}
    if reason is not None:
        print(f"fused kernel not checked, INCONCLUSIVE: {reason}")
    else:
        cases = check_correctness(arguments.quick)
        failed = [case for case in cases if not case["ok"]]
        report["cases"] = cases
        for case in failed[:20]:
            print("FAILED", case)
        worst: dict[str, float] = {}
        for case in cases:
            if "relative_error" in case:
                key = str(case["dtype"])
                error = case["relative_error"]
                assert isinstance(error, float)
                worst[key] = max(worst.get(key, 0.0), error)
        print(
            f"correctness: {len(cases) - len(failed)}/{len(cases)} cases ok; worst relative "
            f"error by dtype {worst}"
        )
        report["worst_relative_error"] = worst
        report["failed"] = len(failed)
        if not failed:
            report["speed"] = speed = check_speed(arguments.quick)
            print(
                f"{'shape':16} {'tokens':>7} {'fused host':>11} {'fused wall':>11} "
                f"{'gather host':>12} {'gather wall':>12} {'gather/fused':>12}"
            )
            for row in speed:
                print(
                    f"{row['shape']:16} {row['n_tokens']:>7} {row['fused_host_us']:>10.1f}u "
                    f"{row['fused_wall_us']:>10.1f}u {row['gathered_host_us']:>11.1f}u "
                    f"{row['gathered_wall_us']:>11.1f}u {row['gathered_over_fused_wall']:>12.2f}"
                )
    if arguments.json:
        with open(arguments.json, "w") as handle:
            json.dump(report, handle, indent=2)
    if reason is not None:
        return ExitStatus.INCONCLUSIVE
    return ExitStatus.VIOLATION if report.get("failed") else ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main())
