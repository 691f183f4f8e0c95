"""Tiny mlx-lm models built in code with seeded random weights: nothing is downloaded.

Shared by the tests that decode through mlx-lm with pool-backed caches.
Default-initialised tiny models repeat one token forever; weights scaled up
by ``WEIGHT_SCALE`` make greedy decoding wander, so a wrong cache shows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen2

WEIGHT_SCALE = 4.0

#: Tokens and per-step log-probabilities of one greedy decode.
Decode = tuple[list[int], list[mx.array]]


def tiny_model(
    architecture: str,
    seed: int,
    *,
    n_layers: int = 2,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    vocab: int = 96,
    dtype: mx.Dtype = mx.float32,
) -> Module:
    """A ``"llama"`` or ``"qwen2"`` model (qwen2 has biased projections) in ``dtype``."""
    module = {"llama": llama, "qwen2": qwen2}[architecture]
    args = module.ModelArgs(
        model_type=architecture,
        hidden_size=n_kv_heads * 2 * head_dim,
        num_hidden_layers=n_layers,
        intermediate_size=96,
        num_attention_heads=n_kv_heads * 2,
        num_key_value_heads=n_kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
    )
    return _seeded(lambda: module.Model(args), seed, dtype)


def _seeded(build: Callable[[], Module], seed: int, dtype: mx.Dtype) -> Module:
    mx.random.seed(seed)
    model = build()
    scaled = tree_map(lambda weight: weight * WEIGHT_SCALE, model.parameters())  # type: ignore[no-untyped-call]
    model.update(scaled)
    model.set_dtype(dtype)
    # Twice: the second marks the weights available here, so threads that decode with
    # the model at once only read them (mlx_storage.publish says why).
    mx.eval(model.parameters())  # type: ignore[no-untyped-call]
    mx.eval(model.parameters())  # type: ignore[no-untyped-call]
    return model


def prompt(seed: int, length: int = 11, vocab: int = 96) -> mx.array:
    """``length`` random token ids below ``vocab``."""
    return mx.random.randint(0, vocab, (length,), key=mx.random.key(seed))


def greedy(
    model: Module, tokens: mx.array, cache: Sequence[object], steps: int, **options: object
) -> Decode:
    """Decode ``steps`` tokens greedily with mlx-lm's ``generate_step`` into ``cache``."""
    decoded: list[int] = []
    logprobs: list[mx.array] = []
    for token, logprob in generate_step(
        tokens,
        model,
        prompt_cache=cache,
        max_tokens=steps,
        **options,  # type: ignore[arg-type]
    ):
        decoded.append(int(token))
        logprobs.append(logprob)
    return decoded, logprobs
