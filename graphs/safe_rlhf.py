"""Safe RLHF: maximise reward subject to expected cost <= budget, by a Lagrange multiplier (Dai et al., 2024).

Reward and cost each have a critic and their own GAE advantages (one compute function, bound by
ports to each); the policy trains on (A_reward - lambda * A_cost) / (1 + lambda). The multiplier lambda
is graph state: it grows while the mean cost is above the budget and shrinks once it is met, and
it is saved in every checkpoint.

The toy task's reward is the copy score; its cost is 1 for a response longer than the answer
(saying more than asked). Both are rules here, where a real run scores with a reward model and a
cost model: replace each g.reward by g.forward(model=..., output="scores") on a model of role
"reward" or "cost" (see graphs/ppo_rm.py).
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {"rollout": {"prompts_per_step": 64, "samples_per_prompt": 4}, "steps": 300}
COST_BUDGET = 0.05  # the expected cost the policy may spend


def build(cfg: RunConfig) -> Graph:
    g = Graph("safe_rlhf")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    g.model("reward_critic", "critic", init_from="actor")
    g.model("cost_critic", "critic", init_from="actor")
    g.state("multiplier", 1.0, low=0.0)

    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.forward("reward_values", model="reward_critic", output="values", reads="responses", writes="reward_values")
    g.forward("cost_values", model="cost_critic", output="values", reads="responses", writes="cost_values")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.reward("cost", fn="verbosity", reads="prompts responses", writes="costs")

    # One GAE compute function, two bindings: the reward side (with the KL penalty) and the cost side.
    g.compute(
        "reward_gae",
        fn="gae",
        reads="rewards reward_values old_logprobs ref_logprobs responses",
        writes="reward_advantages reward_returns",
        ports={"values": "reward_values", "advantages": "reward_advantages", "returns": "reward_returns"},
    )
    g.compute(
        "cost_gae",
        fn="gae",
        reads="costs cost_values responses",
        writes="cost_advantages cost_returns",
        ports={"rewards": "costs", "values": "cost_values", "advantages": "cost_advantages", "returns": "cost_returns"},
    )
    g.compute(
        "lagrangian",
        fn="lagrangian",
        reads="reward_advantages cost_advantages multiplier responses",
        writes="advantages",
    )
    g.compute(
        "multiplier_step", fn="lagrange_update", reads="costs multiplier", updates="multiplier", budget=COST_BUDGET
    )

    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    g.train(
        "train_reward_critic",
        model="reward_critic",
        loss="value",
        reads="responses reward_values reward_returns",
        ports={"values": "reward_values", "returns": "reward_returns"},
    )
    g.train(
        "train_cost_critic",
        model="cost_critic",
        loss="value",
        reads="responses cost_values cost_returns",
        ports={"values": "cost_values", "returns": "cost_returns"},
    )
    return g
