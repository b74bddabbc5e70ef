"""PPO as in RLHF: actor, critic, reference and a learned reward model, all one size (Ouyang et al., 2022).

The reward model scores each response with its scalar head. Locally it starts untrained (a copy
of the base model with a fresh head), so this graph is for planning and for plugging in a real
reward model with --model; graphs/ppo.py is the one that learns the toy tasks.
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {"rollout": {"prompts_per_step": 128, "samples_per_prompt": 4}, "steps": 400}


def build(cfg: RunConfig) -> Graph:
    g = Graph("ppo_rm")
    g.model("actor", "actor")
    g.model("critic", "critic", init_from="actor")
    g.model("ref", "reference", init_from="actor")
    g.model("rm", "reward", init_from="actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.forward("values", model="critic", output="values", reads="responses", writes="values")
    g.forward("score", model="rm", output="scores", reads="responses", writes="rewards")
    g.compute("gae", fn="gae", reads="rewards values old_logprobs ref_logprobs responses", writes="advantages returns")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    g.train("train_critic", model="critic", loss="value", reads="responses values returns")
    return g
