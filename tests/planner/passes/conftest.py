"""The pass tests: ``pass_helpers`` (this folder's helpers) importable by name, and the built-in
plugins' registry."""

from __future__ import annotations

import os
import sys

import pytest

from flowrl.plugins.manager import Registry, load_plugins

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_plugins(entry_points=False)[1]
