"""A user's function that raises or returns non-finite rewards stops the run with one error that
names the node, the function and the step, not a traceback."""

from __future__ import annotations

import types
from typing import Any

import pytest

from flowrl import api
from flowrl.errors import GraphError
from flowrl.graph import Graph
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import load_plugins

TINY = ["steps=2", "seed=0", "progress=false", "checkpoint=false"]
TINY += ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"]


def _boom(prompts: list[Any], responses: list[str], task: Any) -> list[float]:
    if len(prompts) and prompts[0].text:  # every call
        raise ValueError("my reward broke")
    return [0.0] * len(responses)


def _nan(prompts: list[Any], responses: list[str], task: Any) -> list[float]:
    return [float("nan")] * len(responses)


def _registry(fn_name: str) -> Any:
    def build(cfg: Any) -> Graph:
        g = Graph("user_fn")
        g.model("actor", "actor")
        g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
        g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
        g.reward("score", fn=fn_name, reads="prompts responses", writes="rewards")
        g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
        g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
        return g

    module = types.ModuleType("user_fns")
    module.register_algorithms = hookimpl(lambda register: register("user_fn", build))
    module.register_reward_functions = hookimpl(
        lambda register: (register("boom", _boom), register("nan_reward", _nan))
    )
    return load_plugins(entry_points=False, extra=[("user_fns", module)])[1]


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        ("boom", r"^node 'score': reward function 'boom' raised ValueError: my reward broke \(step 0\)\."),
        ("nan_reward", r"^node 'score': reward function 'nan_reward' returned nan .*must be finite \(step 0\)\."),
    ],
)
def test_a_failing_reward_names_node_function_and_step(tmp_path, fn, match):
    reg = _registry(fn)
    g, plan = api.plan("user_fn", registry=reg, overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
    with pytest.raises(GraphError, match=match):
        api.run(g, plan, registry=reg)
