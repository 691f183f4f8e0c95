"""Hypothesis settings profiles shared by every property-based check in the project.

- ``ci``: fast enough for ``pytest -n auto`` on two cores (the default).
- ``nightly``: at least 5,000 examples of up to 100 steps each.
- ``mutation``: derandomised and without shrinking, so that every mutant
  sees the same examples and a kill is found as fast as possible.

The environment variable ``VELOXQUANT_HYPOTHESIS_PROFILE`` selects one
(``tests/conftest.py`` calls :func:`load_profile_from_environment`; the
test cases ``conformance_test_case`` builds carry :func:`profile_settings`,
so it works in a port's own test file with no conftest).

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


PROFILES = ("ci", "nightly", "mutation")


def profile_name() -> str:
    """The profile ``VELOXQUANT_HYPOTHESIS_PROFILE`` names (default ``ci``).

    Raises:
        ValueError: The variable names no registered profile.
    """
    name = os.environ.get(PROFILE_VARIABLE, DEFAULT_PROFILE)
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_VARIABLE} must be one of {PROFILES}, got {name!r}")
    return name


def profile_settings() -> settings:
    """The settings of the profile ``VELOXQUANT_HYPOTHESIS_PROFILE`` names, without loading it.

    Raises:
        ValueError: The variable names no registered profile.
    """
    return settings.get_profile(profile_name())


def load_profile_from_environment() -> str:
    """Load the profile named by ``VELOXQUANT_HYPOTHESIS_PROFILE`` (default ``ci``).

    Raises:
        ValueError: The variable names no registered profile.
    """
    name = profile_name()
    settings.load_profile(name)
    return name
