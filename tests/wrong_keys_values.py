"""Keys and values for one decode write, each wrong in one part alone.

Shared by the tests of the two places that check them: a cache's
``update_and_fetch`` and the store's ``update_through_table``. Both decide with
one fast test first, so each part must be caught alone. The good shape has as
many positions as heads, so a mix-up of those two axes shows.
"""

from __future__ import annotations

import mlx.core as mx

#: A case: the keys, the values, and the error a check must raise.
Case = tuple[object, object, type[Exception]]


def wrong_in_one_part(heads: int, head_dim: int) -> dict[str, Case]:
    """The cases by name, for a float32 store of ``heads`` heads of ``head_dim``."""
    good = (1, heads, heads, head_dim)

    def both(shape: tuple[int, ...]) -> Case:
        return mx.zeros(shape), mx.zeros(shape), ValueError

    return {
        "3-D": both(good[1:]),
        "3-D, one first": both((1, heads, head_dim)),
        "5-D": both((*good, 1)),
        "values of another length": (
            mx.zeros(good),
            mx.zeros((1, heads, heads + 1, head_dim)),
            ValueError,
        ),
        "another head count": both((1, heads + 1, 1, head_dim)),
        "another head count, as many positions as heads": both((1, heads + 1, heads, head_dim)),
        "another head size": both((1, heads, 1, head_dim + 1)),
        "a batch of two": both((2, *good[1:])),
        "keys of another dtype": (mx.zeros(good, mx.float16), mx.zeros(good), TypeError),
        "values of another dtype": (mx.zeros(good), mx.zeros(good, mx.float16), TypeError),
        "values no mlx array": (mx.zeros(good), None, TypeError),
        "keys no mlx array": (None, mx.zeros(good), TypeError),
    }
