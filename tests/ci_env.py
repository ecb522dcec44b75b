"""Whether this run is CI's (``CI=true``), for tests that must fail there instead of skipping.

A module of its own, not ``conftest``: two conftest modules (tests/ and tests/experiment/) share that
import name, so ``from conftest import ...`` could reach the wrong one.
"""

import os


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")
