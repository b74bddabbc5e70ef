"""DAPO: GRPO with clip-higher, a token-level loss, dynamic sampling and overlong shaping (Yu et al., 2025)."""

from flowrl.api import response_budget
from flowrl.graph import Graph
from flowrl.specs import RunConfig

# Clip-higher (ratio clipped to [0.8, 1.28]); no KL term and no reference model. The loss is
# already token-level: flowrl's PPO loss is one mean over every token of the batch.
DEFAULTS = {"algo": {"clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0}, "steps": 300}


def build(cfg: RunConfig) -> Graph:
    g = Graph("dapo")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)

    # The verifiable reward, then dynamic sampling: groups whose samples all score the same have
    # zero advantage, so sample more prompts until the batch holds prompts_per_step groups that
    # differ (at most 3 rounds).
    g.reward("accuracy", fn="task", reads="prompts responses", writes="accuracy")
    g.filter(
        "dynamic_sampling", fn="nonconstant", reads="accuracy responses", ports={"rewards": "accuracy"}, max_rounds=3
    )

    # Soft overlong punishment: responses longer than the budget minus a cache lose up to 1.
    budget = response_budget(cfg)
    g.compute(
        "overlong",
        fn="overlong",
        reads="accuracy responses",
        writes="rewards",
        ports={"rewards": "accuracy", "shaped": "rewards"},
        max_length=budget,
        cache=max(budget // 4, 1),
    )

    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
