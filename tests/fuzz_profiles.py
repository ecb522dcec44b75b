"""Hypothesis profiles of the differential fuzzing tests: ``ci`` (default, within the suite's budget, derandomized so
CI is reproducible) and ``long`` (``RELPOS_FUZZ=long``: many more examples, a fresh random seed each run)."""

import os

from hypothesis import HealthCheck, settings

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=_QUIET)
settings.register_profile("long", max_examples=1500, deadline=None, suppress_health_check=_QUIET)
PROFILE = os.environ.get("RELPOS_FUZZ", "ci")
FUZZ = settings.get_profile(PROFILE)
LONG = PROFILE == "long"


def examples(ci: int, long: int) -> settings:
    """The profile with ``ci`` examples by default and ``long`` under ``RELPOS_FUZZ=long``."""
    return settings(FUZZ, max_examples=long if LONG else ci)
