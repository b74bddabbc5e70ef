"""The local and vLLM generation engines learn alike (issue 21): a short version of
benchmarks/engines_agree.py — GRPO on task 'copy' (16 prompts x 8 samples a step, 40 steps) for two
seeds with each engine (each vLLM run in a subprocess of its own; about two minutes here) — where
both engines learn and their final rewards agree within a bound derived from the seed-to-seed
spread (`agreement`: three standard errors of a difference of means). The spread is the larger of
what the two seeds show and what six more seeds per engine showed at this length (local 0.159 +-
0.020, vLLM 0.147 +- 0.017). Both engines end responses and decode them by one set of rules
(flowrl/contract/responses.py). Skipped where vLLM is not installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from flowrl.plugins.manager import set_registry

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")

ROOT = Path(__file__).resolve().parents[3]


def _benchmark():
    spec = importlib.util.spec_from_file_location("engines_agree", ROOT / "benchmarks" / "engines_agree.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: A smaller batch than the default job's (32 prompts x 16 samples), so four runs fit in about two minutes;
#: 40 steps: learning is under way and the seeds have not yet spread apart (they do from ~70 steps on).
SHORT = ["rollout.prompts_per_step=16", "rollout.samples_per_prompt=8"]
STEPS = 40
#: The final reward's seed-to-seed standard deviation at STEPS, measured over six seeds per engine.
SEED_SD = 0.02


@pytest.mark.slow
def test_the_local_and_vllm_engines_learn_alike_within_the_seed_spread(monkeypatch):
    bench = _benchmark()
    monkeypatch.setenv("FLOWRL_PLUGINS", "vllm")  # the vLLM runs' subprocesses load the plugin
    set_registry(None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the local runs in this process: one thread is faster on a loaded 2-core box
    try:
        out = bench.compare([0, 1], STEPS, ["local", "vllm"], SHORT, emit=print, min_spread=SEED_SD)
    finally:
        torch.set_num_threads(threads)
        set_registry(None)
    print(out)
    for engine in ("local", "vllm"):
        assert out[engine]["mean"] > out[engine]["first"] + 0.1, (engine, out)  # both learn
        assert out[engine]["logprob_gap"] < 1e-5, (engine, out)  # the same policy samples and trains
    assert out["agree"], out  # |mean gap| <= bound (from the seed spread)


def test_a_run_stopped_before_its_steps_is_left_out_of_the_comparison_and_listed():
    bench = _benchmark()

    def run(engine: str, seed: int, final: float, steps_done: int = 60) -> dict:
        rewards = [0.0] * (steps_done - 6) + [final] * 6
        return {"engine": engine, "seed": seed, "steps": 60, "seconds": 1.0, "reward": rewards,
                "exact": rewards, "logprob_gap": 0.0}  # fmt: skip

    runs = [run("local", 0, 0.8), run("vllm", 0, 0.85), run("local", 1, 0.6, steps_done=12), run("vllm", 1, 0.83)]
    out = bench.summary(runs, ["local", "vllm"], tolerance=3.0)
    assert out["incomplete"] == [{"engine": "local", "seed": 1, "steps_done": 12}]
    assert out["local"]["final"] == [0.8] and out["vllm"]["final"] == [0.85, 0.83]  # the stopped run's 0.6 is out
    assert out["gap"] == pytest.approx(0.04, abs=1e-4)
    # an engine with no complete run: no verdict, not a crash
    alone = bench.summary([run("local", 0, 0.8, steps_done=30), run("vllm", 0, 0.85)], ["local", "vllm"], 3.0)
    assert alone["local"] is None and alone["agree"] is None
