"""Shared pytest setup: Hypothesis profiles and the ``tests/`` directory on ``sys.path`` (so
test modules can ``import helpers``).

Profiles: ``ci`` (the default: no deadline, modest example counts, so the suite stays fast on a
2-core machine) and ``thorough`` (more examples). Pick one with ``HYPOTHESIS_PROFILE=thorough``.
Tests set their own ``max_examples`` where they need fewer than the profile's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
