"""GRPO on an OpenEnv (openenv-core 0.3) environment, launched in this process from its Environment class.

The ``openenv`` agent (`flowrl.agents.openenv_env`) serves ``examples/environments/openenv_echo.py``'s
``EchoEnvironment`` on a loopback port with OpenEnv's own app and plays each episode as a chat: the
observation is the user's message, the policy's reply (through the run's OpenAI-compatible endpoint) the
action, the environment's reward the episode's, which ``fn="agent"`` hands to GRPO. The environment draws
each episode at ``reset(seed)``: the ``openenv`` task (`flowrl.tasks.openenv_task`) is only the stream of
seeds, so the episodes are deterministic given the run's seed and a GRPO group plays one episode. Another
environment: change the node's ``environment=`` (or ``base_url=`` for a running server)
changes. See docs/guides/environment-hubs.md.

    flowrl run graphs/openenv_env.py
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {
    "task": "openenv",
    "task_options": {"max_new_tokens": 3},  # "say: ab" -> "ab" and EOS
    "rollout": {"prompts_per_step": 8, "samples_per_prompt": 8},
    "steps": 100,
}


def build(cfg: RunConfig) -> Graph:
    g = Graph("openenv_env")
    g.model("actor", "actor")
    g.generate(
        "episodes",
        model="actor",
        reads="prompts",
        writes="responses",
        n=cfg.rollout.samples_per_prompt,
        agent="openenv",
        environment="examples/environments/openenv_echo.py:EchoEnvironment",
        env_kwargs={"max_len": 2},  # words of 1-2 letters of "abcd"
        timeout=60,
    )
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="agent", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
