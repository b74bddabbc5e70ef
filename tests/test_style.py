"""The code keeps one style: `ruff check` and `ruff format --check` pass (config in pyproject.toml,
lines of at most 120 characters)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["flowrl", "graphs", "plugins", "benchmarks", "tests"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    out = subprocess.run([sys.executable, "-m", "ruff", *command, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
