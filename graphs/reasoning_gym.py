"""GRPO on a reasoning-gym dataset (`flowrl.tasks.reasoning_gym_task`; pip install 'flowrl[reasoning-gym]').

The defaults pick a problem the tiny from-scratch model learns within a minute on a CPU: reasoning-gym's
``count_bits`` for numbers 1..15 ("How many 1 bits are there in the binary representation of the number
13?" -> "3"), scored by the dataset's own ``score_answer``. Another dataset: ``--set
task_options.dataset=NAME`` with its config fields as ``--set task_options.FIELD=VALUE``; a pretrained model:
``--model DIR`` (its chat template renders the questions). See docs/guides/reasoning-gym.md."""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {
    "task": "reasoning_gym",
    "task_options": {
        "dataset": "count_bits",
        "count_bits": {"min_n": 1, "max_n": 15},  # config fields that apply while dataset is count_bits
    },
    "rollout": {"prompts_per_step": 16, "samples_per_prompt": 8},
    "steps": 200,
}


def build(cfg: RunConfig) -> Graph:
    g = Graph("reasoning_gym")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
