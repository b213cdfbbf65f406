"""Shared test configuration: bounded Hypothesis budgets, temp dirs for ipc sockets."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# CI runs on 2 shared cores: examples are bounded, deadlines off (clocks are noisy),
# and derandomized so a red run reproduces.
settings.register_profile(
    "ci",
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
