"""benchmarks/engines_agree.py sets two engines' final rewards side by side: the signed difference of their
means (second engine minus first) with its standard error from each engine's own seed variance, and several
--save files summarised together as one set of runs (seeds run at different times)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import benchmark_module


@pytest.fixture
def bench():
    with benchmark_module("engines_agree") as module:
        yield module


def run(engine: str, seed: int, final: float, steps: int = 60) -> dict:
    rewards = [0.0] * (steps - 6) + [final] * 6  # the last tenth of the steps at ``final``
    return {"engine": engine, "seed": seed, "steps": steps, "seconds": 1.0, "reward": rewards,
            "exact": rewards, "logprob_gap": 0.0}  # fmt: skip


def test_the_difference_is_signed_second_minus_first_with_a_welch_standard_error(bench):
    local, vllm = [0.70, 0.80, 0.90], [0.85, 0.86, 0.87]
    runs = [run("local", i, x) for i, x in enumerate(local)] + [run("vllm", i, x) for i, x in enumerate(vllm)]
    out = bench.summary(runs, ["local", "vllm"], tolerance=3.0)
    assert out["difference"] == pytest.approx(0.06, abs=1e-4)  # vllm's mean over local's
    se = math.sqrt(0.01 / 3 + 0.0001 / 3)  # each engine's own sample variance over its seeds
    assert out["difference_se"] == pytest.approx(se, abs=1e-4)
    assert out["gap"] == pytest.approx(0.06, abs=1e-4)
    flipped = bench.summary(runs, ["vllm", "local"], tolerance=3.0)
    assert flipped["difference"] == pytest.approx(-0.06, abs=1e-4)


def test_one_seed_of_an_engine_gives_no_standard_error(bench):
    out = bench.summary([run("local", 0, 0.8), run("vllm", 0, 0.9), run("vllm", 1, 0.7)], ["local", "vllm"], 3.0)
    assert out["difference"] == pytest.approx(0.0, abs=1e-4)
    assert out["difference_se"] is None


def test_load_summarises_the_runs_of_several_saved_files_together(bench, tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps([run("local", 0, 0.7), run("vllm", 0, 0.8)]))
    second.write_text(json.dumps([run("local", 1, 0.9), run("vllm", 1, 0.8)]))
    out = bench.main(["--load", f"{first},{second}"])
    assert out["seeds"] == [0, 1]
    assert out["local"]["final"] == [0.7, 0.9] and out["vllm"]["final"] == [0.8, 0.8]
    assert out["difference"] == pytest.approx(0.0, abs=1e-4)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out  # the printed line is the summary
