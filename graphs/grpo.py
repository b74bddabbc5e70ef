"""GRPO: group-normalised rewards over n samples per prompt; no critic (Shao et al., 2024).

The graph holds what its loss uses under the run's config: the reference policy only when the KL
penalty counts (``algo.kl_coef > 0``), and a forward pass for the old log-probs only when the batch
is trained on more than once or off-policy -- with one update per batch of a synchronous rollout,
the sampler's log-probs are the old policy's (as TRL does with one iteration per generation batch).
"""

from flowrl.graph import Graph
from flowrl.specs import RunConfig


def build(cfg: RunConfig) -> Graph:
    kl = cfg.algo.kl_coef > 0
    one_update = cfg.train.epochs == 1 and cfg.train.mini_batches == 1 and cfg.rollout.mode == "sync"
    g = Graph("grpo")
    g.model("actor", "actor")
    if kl:
        g.model("ref", "reference", init_from="actor")
    rollout_writes = "responses old_logprobs" if one_update else "responses"
    g.generate("rollout", model="actor", reads="prompts", writes=rollout_writes, n=cfg.rollout.samples_per_prompt)
    if not one_update:
        g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    if kl:
        g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    reads = "responses old_logprobs advantages" + (" ref_logprobs" if kl else "")
    g.train("train_actor", model="actor", loss="ppo", reads=reads)
    return g
