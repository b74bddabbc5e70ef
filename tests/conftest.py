"""Test isolation: no installed plugin leaks into a test, and property tests are seeded.

Entry-point plugins are blocked for every test (``FLOWRL_PLUGINS=""``, inherited by CLI
subprocesses too); a test that exercises entry points sets ``FLOWRL_PLUGINS`` itself with
monkeypatch. Hypothesis runs derandomized (the same examples on every run and machine) with
no per-example deadline (a loaded CI box is slow); ``HYPOTHESIS_PROFILE=explore`` searches
randomly with more examples.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

os.environ["FLOWRL_PLUGINS"] = ""

settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("explore", deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test starts from a registry loaded under its own environment."""
    from flowrl.plugins.manager import set_registry

    set_registry(None)
    yield
    set_registry(None)
