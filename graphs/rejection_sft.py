"""Rejection-sampling SFT (RAFT; Dong et al., 2023): sample n responses per prompt, keep the
single responses the reward accepts, and fine-tune the policy on them with a plain
log-likelihood loss. No reference, no advantages: the filter is the whole algorithm."""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {"algo": {"kl_coef": 0.0}}


def build(cfg: RunConfig) -> Graph:
    g = Graph("rejection_sft")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    # by_row: single responses pass, not whole groups; min_reward 1.0 keeps exact answers only
    # (change it from the command line: --set nodes.select.min_reward=0.9)
    g.filter("select", fn="threshold", reads="rewards responses", by_row=True, min_reward=1.0)
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    return g
