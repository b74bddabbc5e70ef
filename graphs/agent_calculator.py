"""An agent of the user's own, written with the plain `openai` client, trained through the endpoint.

Each episode is one run of ``examples/agents/calculator_agent.py:run``: it asks the policy (served
by the run on loopback, OpenAI-compatible) for a product; a turn starting with ``=`` gets the
calculator's result back as a message, and the next turn answers. The agent returns the reward.
Every request is recorded token in, token out, and trained on exactly as sampled.

    flowrl run graphs/agent_calculator.py
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {
    "task": "calc",
    # an episode's whole budget: three turns of at most 8 tokens and the two ~21-token messages between them
    "rollout": {"prompts_per_step": 16, "samples_per_prompt": 8, "max_new_tokens": 72},
    "steps": 200,
}


def build(cfg: RunConfig) -> Graph:
    g = Graph("agent_calculator")
    g.model("actor", "actor")
    g.generate(
        "episodes",
        model="actor",
        reads="prompts",
        writes="responses",
        n=cfg.rollout.samples_per_prompt,
        agent="examples/agents/calculator_agent.py:run",
        turns=3,
        turn_tokens=8,
        timeout=60,
    )
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="agent", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
