"""The docs tests: ``docblocks`` (this folder's helpers) importable by name, and each block's folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A fresh folder with this checkout's graphs and examples, as a user's clone has them; installed
    plugins load as they do for a user, and ``$FLOWRL_HOME`` is the test's own."""
    for name in ("graphs", "examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWRL_PLUGINS", raising=False)
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "home"))
    return tmp_path
