"""benchmarks/tuner_choice.py's arguments are checked before it profiles the machine or starts Ray: a
calibration of fewer than 4 steps (2 of warm-up, then 2 measured) or of a negative count is refused at once,
with argparse's usage error."""

from __future__ import annotations

import sys

import pytest
from helpers import benchmark_module


@pytest.fixture
def bench():
    with benchmark_module("tuner_choice") as module:
        yield module


@pytest.mark.parametrize("steps", ["-1", "-15", "1", "3"])
def test_a_calibration_too_short_or_negative_is_refused_before_anything_runs(bench, monkeypatch, capsys, steps):
    def started(*args, **kwargs):
        raise AssertionError("the machine was profiled for a calibration the arguments rule out")

    monkeypatch.setattr(bench, "start", started)
    monkeypatch.setattr(sys, "argv", ["tuner_choice.py", f"--calibrate-steps={steps}"])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert "--calibrate-steps must be 0 or at least 4" in capsys.readouterr().err
