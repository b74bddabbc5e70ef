"""Test modules that need an optional package (vLLM, verifiers, OpenEnv, reasoning-gym) skip by
`helpers.needs`, which finds the package without importing it. It must agree with importing it: a
package it wrongly calls missing would skip that package's tests without a failure."""

from __future__ import annotations

import importlib
import sys

import pytest
from helpers import installed

NAMES = ["vllm", "verifiers.v1", "openenv.core", "reasoning_gym", "json.decoder", "no_such_package", "json.no_such"]


@pytest.mark.slow  # imports vLLM, verifiers and OpenEnv (seconds each)
@pytest.mark.parametrize("name", NAMES)
def test_installed_agrees_with_importing(name):
    try:
        importlib.import_module(name)
        importable = True
    except ImportError:
        importable = False
    assert installed(name) == importable


def test_installed_imports_nothing():
    for name in ("no_such_package", "json.no_such"):
        assert not installed(name)
    before = set(sys.modules)
    installed("vllm")
    installed("verifiers.v1")
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("vllm", "verifiers")}
