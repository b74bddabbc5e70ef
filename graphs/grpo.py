"""GRPO: group-normalised rewards over n samples per prompt; no critic (Shao et al., 2024).

The graph holds what its loss uses under the run's config: the reference policy only when the KL
penalty counts (``algo.kl_coef > 0``)."""

from flowrl.graph import Graph
from flowrl.specs import RunConfig


def build(cfg: RunConfig) -> Graph:
    kl = cfg.algo.kl_coef > 0
    g = Graph("grpo")
    g.model("actor", "actor")
    if kl:
        g.model("ref", "reference", init_from="actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    if kl:
        g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    reads = "responses old_logprobs ref_logprobs advantages" if kl else "responses old_logprobs advantages"
    g.train("train_actor", model="actor", loss="ppo", reads=reads)
    return g
