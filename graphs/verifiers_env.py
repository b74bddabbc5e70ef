"""GRPO on a verifiers (0.4) environment: its taskset is the prompt stream, its rubric the reward.

The ``verifiers`` task (`flowrl.tasks.verifiers_task`) draws the environment's own tasks; the ``verifiers``
agent (`flowrl.agents.verifiers_env`) plays each as verifiers does, the policy answering through the run's
OpenAI-compatible endpoint, and returns the rubric's reward, which ``fn="agent"`` hands to GRPO. The default
environment, ``examples/environments/vf_reverse.py`` (reverse a short string of letters), is one the tiny
from-scratch model learns on a CPU; another: ``--set task_options.environment=ID`` (an installed environment,
``prime env install OWNER/NAME`` beforehand) or ``=path/to/env.py``, its config as ``task_options.env_args``.
See docs/guides/environment-hubs.md.

    flowrl run graphs/verifiers_env.py
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {
    "task": "verifiers",
    "task_options": {
        "environment": "examples/environments/vf_reverse.py",
        "env_args": {"count": 16, "max_len": 2},  # 16 tasks: strings of 1-2 letters of "abcd"
    },
    "rollout": {"prompts_per_step": 8, "samples_per_prompt": 8},
    "steps": 100,
}


def build(cfg: RunConfig) -> Graph:
    hub = cfg.task_options  # the agent loads the environment the task draws from (the same tasks, in order)
    g = Graph("verifiers_env")
    g.model("actor", "actor")
    g.generate(
        "episodes",
        model="actor",
        reads="prompts",
        writes="responses",
        n=cfg.rollout.samples_per_prompt,
        agent="verifiers",
        environment=hub["environment"],
        env_args=dict(hub.get("env_args") or {}),
        limit=hub.get("limit"),
        timeout=60,
    )
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="agent", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
