"""How far a benchmark's result is from its reference, checked before anything is timed.

A benchmark that times a new way of computing something (the paged-attention
kernel, a read by runs) first checks that it computes the same thing; this is
the one measure they share. Complexity: O(n) in the elements compared, plus
one evaluation. Thread safety: none needed (pure function of its inputs).
"""

from __future__ import annotations

import mlx.core as mx


def relative_error(out: mx.array, ref: mx.array) -> float:
    """``|out - ref| / |ref|`` over all elements (2-norms), computed in float32."""
    reference = ref.astype(mx.float32).reshape(-1)
    difference = out.astype(mx.float32).reshape(-1) - reference
    error = (mx.linalg.norm(difference) / mx.linalg.norm(reference)).item()
    assert isinstance(error, float), error  # a float32 array's item
    return error
