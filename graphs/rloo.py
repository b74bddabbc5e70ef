"""RLOO: REINFORCE with a leave-one-out baseline over n samples per prompt (Ahmadian et al., 2024)."""

from flowrl.graph import Graph
from flowrl.specs import RunConfig


def build(cfg: RunConfig) -> Graph:
    g = Graph("rloo")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="rloo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs ref_logprobs advantages")
    return g
