"""An agent written with the plain ``openai`` client, unaware of flowrl, trains the policy through the
run's OpenAI-compatible endpoint: it learns (tiny model, fixed seed), and whole runs under every rollout
mode complete with each episode's trained tokens masked as the agent's turns say."""

from __future__ import annotations

from statistics import mean

import pytest
from helpers import ONE_LAYER

from flowrl import api

pytest.importorskip("openai")

GRAPH = """
from flowrl.graph import Graph

DEFAULTS = {"task": "copy", "rollout": {"prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 40}}


def build(cfg):
    g = Graph("retry_agent")
    g.model("actor", "actor")
    g.generate(
        "episodes", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt,
        agent="examples/agents/retry_agent.py:run", turns=2, turn_tokens=8,
    )
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="agent", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""


def run(tmp_path, steps, *extra):
    path = tmp_path / "retry_graph.py"
    path.write_text(GRAPH)
    overrides = [f"steps={steps}", "seed=0", "progress=false", "checkpoint=false", f"out={tmp_path / 'out'}", *extra]
    graph, plan = api.plan(str(path), overrides=overrides, emit=lambda s: None)
    return plan, api.run(graph, plan)


@pytest.mark.slow
def test_a_plain_openai_agent_with_a_second_try_teaches_the_copy_task(tmp_path):
    # seed 0, one layer, lr 3e-3: reward 0.013 -> 0.086 over 40 steps (~1 s a step)
    _, result = run(tmp_path, 40, ONE_LAYER, "train.lr=3e-3")
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"retry agent, copy: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.04
    assert all(m["episodes/agent_errors"] == 0 and m["episodes/refused"] == 0 for m in result.metrics)
    assert mean(m["episodes/requests"] for m in result.metrics) > 64  # second tries were asked for


@pytest.mark.parametrize("mode", ["one_step_off", "async", "partial", "streaming"])
@pytest.mark.slow
def test_agent_episodes_run_under_every_rollout_mode(tmp_path, mode):
    overrides = (f"rollout.mode={mode}", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2")
    plan, result = run(tmp_path, 2, ONE_LAYER, *overrides)
    assert len(result.metrics) == 2
    for m in result.metrics:
        assert m["episodes/samples"] == 4 and m["episodes/agent_errors"] == 0 and m["episodes/timeouts"] == 0
        assert m["episodes/turns"] >= 1 and m["episodes/requests"] >= 4


@pytest.mark.slow
def test_a_seeded_agent_run_repeats_exactly(tmp_path):
    """Requests are decoded once every running episode has sent its own, in the episodes' order: when
    requests arrive does not change what is sampled."""

    def metrics(folder):
        _, result = run(folder, 2, ONE_LAYER, "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4")
        timed = ("seconds", "_s", "per_s", "spans")
        return [{k: v for k, v in m.items() if not any(t in k for t in timed)} for m in result.metrics]

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert first == second and first[0]["episodes/unsettled_decodes"] == 0
