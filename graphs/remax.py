"""ReMax: REINFORCE with the greedy response's reward as the baseline (Li et al., 2023)."""

from flowrl.graph import Graph
from flowrl.specs import RunConfig


def build(cfg: RunConfig) -> Graph:
    g = Graph("remax")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.generate("greedy", model="actor", reads="prompts", writes="greedy_responses", greedy=True)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.reward("baseline_reward", fn="task", reads="prompts greedy_responses", writes="baseline_rewards")
    g.compute("advantages", fn="remax", reads="rewards baseline_rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs ref_logprobs advantages")
    return g
