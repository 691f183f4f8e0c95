"""Synthetic serving workloads: seeded request streams for the pool simulator.

A workload is a list of :class:`Request` records, fully drawn up front from a
seed, so that the same seed always yields the same traffic whatever the pool
looks like. Capacity planning relies on that: comparing two pool sizes is only
meaningful if both see identical requests.

The distributions, and why they are the defaults:

* **Arrivals** form a Poisson process: gaps between requests are exponential
  with mean ``1 / arrival_rate`` steps, and a request arriving at time ``t``
  joins the queue at step ``floor(t)``. Independent users sending requests look
  like this over short windows.
* **Prompt lengths** default to a *lognormal* with the given mean and shape
  ``prompt_sigma``: strictly positive, right-skewed, with the long tail of huge
  prompts (pasted documents, long chat histories) that real traces show and
  that decides the pool's worst case. ``fixed`` (every prompt is the mean) and
  ``uniform`` (on ``1 .. 2 * mean - 1``) are there for controlled experiments.
* **Decode lengths** default to *geometric* with the given mean: the model
  emits the stop token with the same probability ``1 / mean`` at every step,
  which is the memoryless model of generation. ``lognormal`` (shape
  ``decode_sigma``) fits traces whose outputs cluster around a typical length,
  and ``fixed`` gives every request the mean.
* **Aborts**: each request is, with probability ``abort_fraction``, abandoned
  by its client mid-decode, after a number of generated tokens drawn uniformly
  from ``0 .. decode_len - 1`` (so always before it would have finished).

Every length is rounded to an int and clamped so that ``prompt_len >= 1``,
``decode_len >= 1`` and ``prompt_len + decode_len <= max_seq_len`` (the
model's context window).

Each aspect (arrivals, prompts, decodes, aborts) draws from its own random
stream derived from the seed, so changing, say, the abort fraction leaves the
arrival times and lengths untouched.

Complexity: :func:`generate_workload` is O(number of requests).
Thread safety: pure functions over immutable values; safe from any thread.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal, get_args

PromptDistribution = Literal["lognormal", "fixed", "uniform"]
DecodeDistribution = Literal["geometric", "lognormal", "fixed"]

PROMPT_DISTRIBUTIONS: tuple[str, ...] = get_args(PromptDistribution)
DECODE_DISTRIBUTIONS: tuple[str, ...] = get_args(DecodeDistribution)

#: The largest lognormal shape. The mean is kept by ``mu = log(mean) - sigma**2 / 2``,
#: so at 10 the median length is ``mean * exp(-50)`` and almost every length rounds
#: to one token (real traces fit shapes of about 0.5 to 2); far above it the draw
#: overflows to NaN.
MAX_SIGMA = 10.0


@dataclass(frozen=True)
class WorkloadConfig:
    """The request mix: how often requests arrive and how long they are.

    Invariants (checked on construction, ``ValueError`` naming the field):
    ``arrival_rate > 0``; ``1 <= prompt_mean`` and ``1 <= decode_mean``;
    ``0 <= prompt_sigma <= MAX_SIGMA`` and ``0 <= decode_sigma <= MAX_SIGMA``;
    ``0 <= abort_fraction <= 1``; ``max_seq_len >= 2`` (room for one prompt
    token and one generated token).
    """

    arrival_rate: float = 0.1  # mean requests arriving per simulated step
    prompt_mean: int = 256  # mean prompt length, tokens
    prompt_dist: PromptDistribution = "lognormal"
    prompt_sigma: float = 0.8  # lognormal shape of prompt lengths
    decode_mean: int = 128  # mean generated length, tokens
    decode_dist: DecodeDistribution = "geometric"
    decode_sigma: float = 0.6  # lognormal shape of decode lengths (lognormal only)
    abort_fraction: float = 0.05  # share of requests abandoned mid-decode
    max_seq_len: int = 4096  # context window: cap on prompt + decode tokens

    def __post_init__(self) -> None:
        _require(self.arrival_rate > 0, "arrival_rate must be > 0", self.arrival_rate)
        _require(self.prompt_mean >= 1, "prompt_mean must be >= 1", self.prompt_mean)
        _require(self.decode_mean >= 1, "decode_mean must be >= 1", self.decode_mean)
        for name in ("prompt_sigma", "decode_sigma"):
            sigma = getattr(self, name)
            _require(0 <= sigma <= MAX_SIGMA, f"{name} must be between 0 and {MAX_SIGMA:g}", sigma)
        _require(
            0 <= self.abort_fraction <= 1,
            "abort_fraction must be between 0 and 1",
            self.abort_fraction,
        )
        _require(self.max_seq_len >= 2, "max_seq_len must be >= 2", self.max_seq_len)
        _require(
            self.prompt_dist in PROMPT_DISTRIBUTIONS,
            f"prompt_dist must be one of {PROMPT_DISTRIBUTIONS}",
            self.prompt_dist,
        )
        _require(
            self.decode_dist in DECODE_DISTRIBUTIONS,
            f"decode_dist must be one of {DECODE_DISTRIBUTIONS}",
            self.decode_dist,
        )


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    Invariants: ``prompt_len >= 1``; ``decode_len >= 1``; ``prompt_len +
    decode_len`` is at most the workload's ``max_seq_len``; ``abort_after`` is
    ``None`` (runs to completion) or in ``0 .. decode_len - 1``.
    """

    request_id: int  # unique within a workload; used as the pool owner id
    arrival_step: int  # step at which the request joins the waiting queue
    prompt_len: int  # tokens to prefill at admission
    decode_len: int  # tokens to generate before completing
    abort_after: int | None  # client disconnects after this many generated tokens


def _require(condition: bool, message: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{message}, got {value!r}")


def _stream(seed: int, aspect: str) -> random.Random:
    """Return the random stream for one aspect of the workload.

    String seeds are hashed with SHA-512 by :mod:`random`, independently of
    ``PYTHONHASHSEED``, so the streams are stable across processes.
    """
    return random.Random(f"veloxquant-simulate:{seed}:{aspect}")


def _lognormal(rng: random.Random, mean: int, sigma: float) -> int:
    # Choose mu so that the distribution's mean (exp(mu + sigma^2 / 2)) is `mean`.
    mu = math.log(mean) - sigma * sigma / 2
    return round(rng.lognormvariate(mu, sigma))


def _geometric(rng: random.Random, mean: int) -> int:
    """Trials up to and including the first success, success probability 1/mean."""
    if mean == 1:
        return 1
    uniform = 1.0 - rng.random()  # in (0, 1], so the log is finite
    return 1 + math.floor(math.log(uniform) / math.log1p(-1.0 / mean))


def _prompt_length(rng: random.Random, config: WorkloadConfig) -> int:
    if config.prompt_dist == "fixed":
        length = config.prompt_mean
    elif config.prompt_dist == "uniform":
        length = rng.randint(1, 2 * config.prompt_mean - 1)
    else:
        length = _lognormal(rng, config.prompt_mean, config.prompt_sigma)
    return min(max(length, 1), config.max_seq_len - 1)


def _decode_length(rng: random.Random, config: WorkloadConfig, prompt_len: int) -> int:
    if config.decode_dist == "fixed":
        length = config.decode_mean
    elif config.decode_dist == "lognormal":
        length = _lognormal(rng, config.decode_mean, config.decode_sigma)
    else:
        length = _geometric(rng, config.decode_mean)
    return min(max(length, 1), config.max_seq_len - prompt_len)


def _abort_point(rng: random.Random, fraction: float, decode_len: int) -> int | None:
    # Both draws happen for every request so that the stream stays aligned
    # across abort fractions: request i's abort point depends only on i.
    abandons = rng.random() < fraction
    point = rng.randrange(decode_len)
    return point if abandons else None


def arrival_steps(
    config: WorkloadConfig,
    seed: int,
    *,
    until_step: int | None = None,
    max_requests: int | None = None,
) -> list[int]:
    """Draw Poisson arrival steps, in non-decreasing order.

    Stops before the first arrival at or after ``until_step`` and after
    ``max_requests`` arrivals, whichever comes first; at least one bound must
    be given.

    Raises:
        ValueError: Neither bound was given.
    """
    if until_step is None and max_requests is None:
        raise ValueError("arrival_steps needs until_step or max_requests, got neither")
    rng = _stream(seed, "arrivals")
    steps: list[int] = []
    time = 0.0
    while max_requests is None or len(steps) < max_requests:
        time += rng.expovariate(config.arrival_rate)
        if not math.isfinite(time):  # a rate so small that the next arrival never comes
            break
        step = math.floor(time)
        if until_step is not None and step >= until_step:
            break
        steps.append(step)
    return steps


def generate_workload(
    config: WorkloadConfig,
    seed: int,
    *,
    until_step: int | None = None,
    max_requests: int | None = None,
) -> list[Request]:
    """Draw a workload: requests ordered by arrival, ids ``0, 1, 2, ...``.

    Args:
        config: The request mix.
        seed: Any int; the same seed and config always give the same list.
        until_step: Only requests arriving before this step are drawn.
        max_requests: At most this many requests are drawn.

    Returns:
        The requests, sorted by ``arrival_step`` (ties in id order).

    Raises:
        ValueError: Neither ``until_step`` nor ``max_requests`` was given.
    """
    steps = arrival_steps(config, seed, until_step=until_step, max_requests=max_requests)
    prompts = _stream(seed, "prompts")
    decodes = _stream(seed, "decodes")
    aborts = _stream(seed, "aborts")
    requests: list[Request] = []
    for request_id, step in enumerate(steps):
        prompt_len = _prompt_length(prompts, config)
        decode_len = _decode_length(decodes, config, prompt_len)
        abort_after = _abort_point(aborts, config.abort_fraction, decode_len)
        requests.append(Request(request_id, step, prompt_len, decode_len, abort_after))
    return requests
