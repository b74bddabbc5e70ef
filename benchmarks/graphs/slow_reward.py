"""GRPO on the copy task whose reward also waits ``FLOWRL_REWARD_MS`` (default 50) ms per response,
as a remote verifier or a sandboxed test run would (benchmarks/reward_pool.py)."""

import os
import time

from flowrl import register
from flowrl.algorithms.ops import task_reward
from flowrl.graph import Graph


@register.reward("slow_task")
def slow_task(prompts, responses, task):
    time.sleep(float(os.environ.get("FLOWRL_REWARD_MS", "50")) / 1000 * len(responses))
    return task_reward(prompts, responses, task)


def build(cfg):
    g = Graph("slow")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="slow_task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
