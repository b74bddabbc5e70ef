"""A custom algorithm in one file: its own reward and compute function (advantages), registered here."""

import torch

from flowrl import register
from flowrl.graph import Graph


@register.reward("concise")
def concise(prompts, responses, task):
    """The task's score, minus 0.02 per character beyond the answer's length."""
    return [task.score(p, r) - 0.02 * max(len(r) - len(p.answer), 0) for p, r in zip(prompts, responses)]


@register.compute("rank", needs=("scores", "responses"), gives=("advantages",))
def rank(inputs, algo):
    """Each response's rank among the samples of its prompt, scaled to [-1, 1], on every token."""
    scores, seqs = inputs["scores"], inputs["responses"]
    adv = torch.zeros_like(scores)
    for group in seqs.prompt_index.unique():
        rows = (seqs.prompt_index == group).nonzero().flatten()
        ranks = scores[rows].argsort().argsort().float()
        adv[rows] = 2 * ranks / max(len(rows) - 1, 1) - 1
    return {"advantages": adv[:, None] * seqs.sampled_mask}


def build(cfg):
    g = Graph("custom")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.reward("reward", fn="concise", reads="prompts responses", writes="rewards")
    # the compute function's input port 'scores' reads the graph key 'rewards'
    g.compute("advantages", fn="rank", reads="rewards responses", writes="advantages", ports={"scores": "rewards"})
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs ref_logprobs advantages")
    return g
