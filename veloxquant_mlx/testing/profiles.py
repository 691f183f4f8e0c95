"""Hypothesis settings profiles shared by every property-based check in the project.

- ``ci``: fast enough for ``pytest -n auto`` on two cores (the default).
- ``nightly``: at least 5,000 examples of up to 100 steps each.
- ``mutation``: derandomised and without shrinking, so that every mutant
  sees the same examples and a kill is found as fast as possible.

The environment variable ``VELOXQUANT_HYPOTHESIS_PROFILE`` selects one
(``tests/conftest.py`` calls :func:`load_profile_from_environment`).

Complexity and thread safety: registration only, at import.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

PROFILE_VARIABLE = "VELOXQUANT_HYPOTHESIS_PROFILE"
DEFAULT_PROFILE = "ci"

# Stateful runs are slow by Hypothesis's standards and a pool step has no deadline.
_COMMON = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

settings.register_profile("ci", _COMMON, max_examples=150, stateful_step_count=40)
settings.register_profile("nightly", _COMMON, max_examples=5_000, stateful_step_count=100)
settings.register_profile(
    "mutation",
    _COMMON,
    max_examples=200,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


def load_profile_from_environment() -> str:
    """Load the profile named by ``VELOXQUANT_HYPOTHESIS_PROFILE`` (default ``ci``).

    Raises:
        ValueError: The variable names no registered profile.
    """
    name = os.environ.get(PROFILE_VARIABLE, DEFAULT_PROFILE)
    known = ("ci", "nightly", "mutation")
    if name not in known:
        raise ValueError(f"{PROFILE_VARIABLE} must be one of {known}, got {name!r}")
    settings.load_profile(name)
    return name
