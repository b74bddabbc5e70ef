"""Code RL: GRPO on model-written Python, scored by running it against tests in the sandbox.

The expr task asks for the body of ``f = lambda x: ...`` ('add 3>') that passes four asserts held
in the prompt (``prompt.meta["tests"]``). The built-in ``code`` reward runs each response in
bubblewrap (no network, no project files, CPU/memory/process/output limits) and scores the
fraction of asserts passed; a group's repeated answers run once. Some asserts test a property of
the function (its slope), so a partly right answer ('x', '3') earns part of the reward and a tiny
model trained from scratch climbs towards 'x+3'. ``reward.workers`` runs the sandboxes in parallel.
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {
    "task": "expr",
    "rollout": {"prompts_per_step": 16, "samples_per_prompt": 8},
    "reward": {"workers": 2, "rows_per_call": 8},
    "steps": 200,
}


def build(cfg: RunConfig) -> Graph:
    g = Graph("code_rl")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="code", reads="prompts responses", writes="rewards", template="f = lambda x: {response}")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
