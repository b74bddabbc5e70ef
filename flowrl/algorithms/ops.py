"""Graph-facing wrappers around the tensor math: compute functions, losses, reward functions.

Each wrapper reads the keys its node declares (by their conventional names), calls the plain
tensor functions in `advantages` / `losses`, and returns the keys it produces, with the
metrics it owns (``kl`` where it sees the reference, ``exact`` for task rewards). What each
one needs and gives is registered with it, so the planner's `resolve` pass can check a
graph's keys before anything runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flowrl.algorithms import advantages as adv
from flowrl.algorithms import losses
from flowrl.runtime.batch import Sequences, sequences_in
from flowrl.specs import AlgoConfig
from flowrl.tasks.builtin import Prompt

Batch = dict[str, Any]


def _token_rewards(
    inputs: Batch, seqs: Sequences, algo: AlgoConfig, kl_coef: float | None
) -> tuple[Tensor, dict[str, float]]:
    """Sequence reward on the last token, minus a per-token KL penalty when both log-probs are read.

    r_t = score * [t = last] - beta * (log pi_old(a_t) - log pi_ref(a_t))

    Metric ``kl``: the masked mean of the k3 estimate of KL(pi_old || ref) when both are read.
    """
    mask = seqs.response_mask
    rewards = adv.sequence_to_token_rewards(inputs["rewards"].float(), mask)
    metrics: dict[str, float] = {}
    if "old_logprobs" in inputs and "ref_logprobs" in inputs:
        old, ref = inputs["old_logprobs"], inputs["ref_logprobs"]
        metrics["kl"] = round(float(adv.masked_mean(losses.kl_penalty(old, ref, "k3"), mask)), 6)
        beta = algo.kl_coef if kl_coef is None else kl_coef
        if beta:
            rewards = rewards - beta * losses.kl_penalty(old, ref, "k1") * mask
    return rewards, metrics


# ---------------------------------------------------------------- compute functions


def gae_op(
    inputs: Batch, algo: AlgoConfig, *, kl_coef: float | None = None
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """PPO: GAE(gamma, lambda) over token rewards with the KL penalty in the reward."""
    seqs = sequences_in(inputs, "advantage estimator 'gae'")
    mask = seqs.response_mask
    values = inputs["values"].float() * mask
    rewards, metrics = _token_rewards(inputs, seqs, algo, kl_coef)
    advantages, returns = adv.gae(rewards, values, mask, gamma=algo.gamma, lam=algo.lam)
    if algo.whiten_advantages:
        advantages = adv.masked_whiten(advantages, mask)
    return {"advantages": advantages, "returns": returns}, metrics


def grpo_op(inputs: Batch, algo: AlgoConfig, *, eps: float = 1e-6, scale: bool = True) -> dict[str, Tensor]:
    """GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + eps), the same for every token."""
    seqs = sequences_in(inputs, "advantage estimator 'grpo'")
    a = adv.grpo(inputs["rewards"].float(), seqs.prompt_index, eps=eps, scale=scale)
    return {"advantages": adv.broadcast_to_tokens(a, seqs.response_mask)}


def rloo_op(inputs: Batch, algo: AlgoConfig) -> dict[str, Tensor]:
    """RLOO: A_i = r_i - mean of the other samples of the same prompt."""
    seqs = sequences_in(inputs, "advantage estimator 'rloo'")
    a = adv.rloo(inputs["rewards"].float(), seqs.prompt_index)
    return {"advantages": adv.broadcast_to_tokens(a, seqs.response_mask)}


def remax_op(inputs: Batch, algo: AlgoConfig) -> dict[str, Tensor]:
    """ReMax: A_i = r_i - r(greedy response of the same prompt), scaled by the batch std.

    Scaling only (no mean shift, which would undo the greedy baseline) keeps the step size
    independent of the reward scale: early on every r_i - b_i is tiny.
    """
    seqs = sequences_in(inputs, "advantage estimator 'remax'")
    baseline = inputs["baseline_rewards"].float()[seqs.prompt_index]
    a = adv.broadcast_to_tokens(adv.remax(inputs["rewards"].float(), baseline), seqs.response_mask)
    if algo.whiten_advantages:
        a = adv.masked_whiten(a, seqs.response_mask, shift_mean=False)
    return {"advantages": a}


def reinforce_pp_op(
    inputs: Batch, algo: AlgoConfig, *, kl_coef: float | None = None
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """REINFORCE++: discounted token returns (KL in the reward), whitened over the batch."""
    seqs = sequences_in(inputs, "advantage estimator 'reinforce_pp'")
    rewards, metrics = _token_rewards(inputs, seqs, algo, kl_coef)
    return {"advantages": adv.reinforce_pp(rewards, seqs.response_mask, gamma=algo.gamma)}, metrics


# ---------------------------------------------------------------- losses


def ppo_loss(logprobs: Tensor, batch: Batch, algo: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip (clip-higher, dual-clip) + beta * KL(pi || ref) when the node reads ref_logprobs (metric ``kl``);
    tokens sampled by older weights weigh pi_prox / pi_behav (``algo.is_correction``, decoupled PPO)."""
    seqs = sequences_in(batch, "loss 'ppo'")
    mask = seqs.response_mask
    weights, is_stats = None, {}
    if seqs.logprobs is not None and seqs.versions is not None and "policy_version" in batch:
        weights, is_stats = losses.behaviour_weights(
            batch["old_logprobs"],
            seqs.logprobs,
            seqs.versions,
            int(batch["policy_version"]),
            mask,
            algo.is_correction,
            algo.is_cap,
        )
    loss, stats = losses.ppo_policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        mask,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        dual_clip=algo.dual_clip,
        weights=weights,
    )
    stats.update(is_stats)
    if "ref_logprobs" in batch:
        kl = adv.masked_mean(losses.kl_penalty(logprobs, batch["ref_logprobs"], algo.kl_estimator), mask)
        stats["kl"] = float(kl.detach())
        if algo.kl_coef:
            loss = loss + algo.kl_coef * kl
    return loss, stats


def value_loss(values: Tensor, batch: Batch, algo: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss, scaled by vf_coef."""
    mask = sequences_in(batch, "loss 'value'").response_mask
    loss, stats = losses.value_loss(values, batch["values"], batch["returns"], mask, clip=algo.vf_clip)
    return algo.vf_coef * loss, stats


# ---------------------------------------------------------------- reward functions


def task_reward(prompts: list[Prompt], responses: list[str], task: Any) -> tuple[Tensor, dict[str, float]]:
    """The task's own rule-based score of each response (metric ``exact``: the fraction scoring 1)."""
    scores = torch.tensor([task.score(p, r) for p, r in zip(prompts, responses)], dtype=torch.float32)
    return scores, {"exact": round(float((scores == 1.0).float().mean()), 4) if len(scores) else 0.0}


COMPUTE_FUNCTIONS = {
    "gae": (gae_op, {"needs": ("rewards", "values", "responses"), "gives": ("advantages", "returns")}),
    "grpo": (grpo_op, {"needs": ("rewards", "responses"), "gives": ("advantages",)}),
    "rloo": (rloo_op, {"needs": ("rewards", "responses"), "gives": ("advantages",)}),
    "remax": (remax_op, {"needs": ("rewards", "baseline_rewards", "responses"), "gives": ("advantages",)}),
    "reinforce_pp": (reinforce_pp_op, {"needs": ("rewards", "responses"), "gives": ("advantages",)}),
}
LOSSES = {
    "ppo": (ppo_loss, {"needs": ("old_logprobs", "advantages"), "output": "logprobs"}),
    "value": (value_loss, {"needs": ("values", "returns"), "output": "values"}),
}
REWARD_FUNCTIONS = {"task": task_reward}
