"""LLM-as-judge: GRPO whose reward is a frozen judge model's verdict.

``g.judge`` adds three nodes: ``judge_prompts`` fills the template with each question and
response, ``judge_generate`` has the judge write one greedy verdict per response, and ``judge``
parses the verdict's first number (divided by ``scale``) as the response's reward. The judge is a
``reference`` model: frozen, with generation engines of its own. Give it its own weights with
``--model actor=POLICY_DIR,judge=JUDGE_DIR``; without, it starts as a copy of the policy.
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nRate the answer from 0 to 9. Rating:"


def build(cfg: RunConfig) -> Graph:
    g = Graph("judge")
    g.model("actor", "actor")
    g.model("judge", "reference", init_from="actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.judge("judge", model="judge", template=TEMPLATE, writes="rewards", scale=9.0)
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
