"""Tool calling in the chat format: GRPO over episodes where the model may call tools.

The prompts are chat messages (the data task). The ``arithmetic`` environment offers
``multiply(a, b)`` and ``add(a, b)``: their JSON schemas go into the prompt through the chat
template (``apply_chat_template(tools=...)``, here examples/templates/chatml_tools.jinja). A model
turn's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks are parsed and run, each
result goes back as a ``tool`` message rendered by the template, and the model turns again; a turn
without a call is its final answer. Each model turn has its own budget (``turn_tokens``), tool
results another (``env_tokens``). The ``episode`` reward scores the final turn only (a number a tool
wrote does not count) plus the environment's turn rewards (``penalty`` for a malformed call).

    flowrl run graphs/tool_chat.py --model DIR    # an instruct model's HF folder
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

DEFAULTS = {
    "task": "data",
    "data": {
        "train": ["examples/data/multiply.jsonl"],
        "chat_template": "examples/templates/chatml_tools.jinja",
        "verifier": "math",
    },
    "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4},
    "steps": 100,
}


def build(cfg: RunConfig) -> Graph:
    g = Graph("tool_chat")
    g.model("actor", "actor")
    g.generate(
        "episodes",
        model="actor",
        reads="prompts",
        writes="responses",
        n=cfg.rollout.samples_per_prompt,
        env="arithmetic",
        turns=3,
        turn_tokens=64,
        env_tokens=96,
        penalty=-0.1,
    )
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="episode", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
