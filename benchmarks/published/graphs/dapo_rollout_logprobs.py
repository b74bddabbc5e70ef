"""DAPO as verl's fully-async trainer runs it in benchmarks/published: the rollout's own log-probs
serve as the old policy's (the docs' old_log_prob column is empty for these rows), so no forward
pass before the update; no reference model and no dynamic-sampling filter."""

from flowrl import register
from flowrl.errors import ConfigError
from flowrl.graph import Graph
from flowrl.specs import RunConfig


@register.loss("ppo_rollout_logprobs", needs=("advantages",))
def ppo_rollout_logprobs(logprobs, batch, algo):
    """PPO-clip against the log-probs the rollout sampled with (the behaviour policy's)."""
    from flowrl.algorithms import losses
    from flowrl.runtime.batch import sequences_in

    seqs = sequences_in(batch, "loss 'ppo_rollout_logprobs'")
    if seqs.logprobs is None:
        raise ConfigError("loss 'ppo_rollout_logprobs' needs the generation engine's sampled log-probs.")
    return losses.ppo_policy_loss(
        logprobs,
        seqs.logprobs,
        batch["advantages"],
        seqs.sampled_mask,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        dual_clip=algo.dual_clip,
    )


def build(cfg: RunConfig) -> Graph:
    g = Graph("dapo_rollout_logprobs")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo_rollout_logprobs", reads="responses advantages")
    return g
