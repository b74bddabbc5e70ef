"""Multi-turn tool use: the model answers with a calculator it must call, GRPO over whole episodes.

The calc task asks for a product of two numbers too many to learn by heart ('37*58:'). A model
turn that is just '=' presses the calculator's key: the environment writes the result and '|'
into the response, and the model's next turn is its answer ('2146'). Only the model's own tokens
are trained; the reward scores the final answer. A model that learns to call the tool and copy
its result solves the task.
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {"task": "calc", "rollout": {"prompts_per_step": 32, "samples_per_prompt": 8}, "steps": 300}


def build(cfg: RunConfig) -> Graph:
    g = Graph("tool_use")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    g.generate(
        "episodes",
        model="actor",
        reads="prompts",
        writes="responses",
        n=cfg.rollout.samples_per_prompt,
        env="calculator",
        turns=2,
    )
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs ref_logprobs advantages")
    return g
