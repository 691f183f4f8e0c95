"""The attention hook on its own: which modules it rebinds, and what its dispatcher
passes where.

The forward passes through the hook (decodes that must match ``KVCache``) are in
``test_paged_attention.py`` and ``test_batch_cache.py``; here the dispatcher is
driven with stand-ins, so each argument it passes on is checked by identity.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest
from mlx.nn.layers.base import Module
from mlx_lm.models import base
from tiny_models import tiny_model

from veloxquant_mlx.memory import attention_hook
from veloxquant_mlx.memory.attention_hook import (
    install_paged_attention,
    uninstall_paged_attention,
)


class _TwoModels(Module):
    """A model whose layers come from two mlx-lm modules, as a wrapper of a language
    model's does (its own class is in this test module, which binds no attention)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.first = tiny_model("llama", 1)
        self.second = tiny_model("qwen2", 2)


def test_each_module_of_the_model_s_layers_is_rebound_and_each_restored() -> None:
    model = _TwoModels()
    modules = [sys.modules[type(part).__module__] for part in (model.first, model.second)]
    assert install_paged_attention(model) == 2
    try:
        assert all(
            module.scaled_dot_product_attention is not base.scaled_dot_product_attention
            for module in modules
        )
    finally:
        assert uninstall_paged_attention(model) == 2
    assert all(
        module.scaled_dot_product_attention is base.scaled_dot_product_attention
        for module in modules
    )


class _ModulesNotCallable:
    modules = 3


@pytest.mark.parametrize(
    "model", [object(), _ModulesNotCallable()], ids=["no modules", "not callable"]
)
def test_what_is_no_mlx_module_is_refused_naming_its_type(model: object) -> None:
    expected = rf"^model must be an mlx\.nn\.Module, got {type(model).__name__}$"
    with pytest.raises(TypeError, match=expected):
        install_paged_attention(model)
    with pytest.raises(TypeError, match=expected):
        uninstall_paged_attention(model)


class _Batch:
    """A cache that attends row by row (``AttendsRows``), answering ``answer``."""

    def __init__(self, answer: mx.array | None) -> None:
        self.answer = answer
        self.asked: list[tuple[mx.array, float, object]] = []

    def attend_rows(self, queries: mx.array, scale: float, mask: object) -> mx.array | None:
        self.asked.append((queries, scale, mask))
        return self.answer


class _Original:
    """mlx-lm's attention function, standing in: records each call's keywords."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []
        self.answer = mx.zeros((1,))

    def __call__(  # noqa: PLR0917 (mlx-lm's signature)
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: object,
        scale: float,
        mask: object,
        sinks: mx.array | None = None,
    ) -> mx.array:
        self.calls.append({"cache": cache, "scale": scale, "mask": mask, "sinks": sinks})
        return self.answer


QUERIES, KEYS, VALUES = mx.ones((2, 4, 3, 8)), mx.ones((2, 2, 5, 8)), mx.ones((2, 2, 5, 8))


def test_a_batch_s_answer_is_returned_and_it_is_asked_with_the_caller_s_mask() -> None:
    original, batch, mask = _Original(), _Batch(mx.full((1,), 7.0)), mx.array([True])
    dispatch = attention_hook._dispatcher(original)
    got = dispatch(QUERIES, KEYS, VALUES, cache=batch, scale=0.5, mask=mask)
    assert got is batch.answer
    [(queries, scale, asked_mask)] = batch.asked
    assert (queries is QUERIES, scale, asked_mask is mask) == (True, 0.5, True)
    assert original.calls == []


def test_what_the_caches_decline_goes_to_the_original_with_every_argument() -> None:
    original, batch, sinks = _Original(), _Batch(None), mx.zeros((4,))
    dispatch = attention_hook._dispatcher(original)
    assert dispatch(QUERIES, KEYS, VALUES, cache=batch, scale=0.5, mask="causal") is original.answer
    # With attention sinks the batch is not asked at all.
    assert (
        dispatch(QUERIES, KEYS, VALUES, cache=batch, scale=0.5, mask=None, sinks=sinks)
        is original.answer
    )
    assert len(batch.asked) == 1
    first, second = original.calls
    assert first == {"cache": batch, "scale": 0.5, "mask": "causal", "sinks": None}
    assert (second["cache"], second["mask"], second["sinks"] is sinks) == (batch, None, True)
