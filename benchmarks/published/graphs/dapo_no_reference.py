"""DAPO as verl's colocated baseline runs it in benchmarks/published: GRPO-style advantages, the
actor's log-probs recomputed before the update (verl's old_log_prob), no reference model
(use_kl_loss False, kl_coef 0) and no dynamic-sampling filter."""

from flowrl.graph import Graph
from flowrl.specs import RunConfig


def build(cfg: RunConfig) -> Graph:
    g = Graph("dapo_no_reference")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
