"""Policy / value losses and KL estimators for RL post-training of LLMs.

Plain tensor functions, no state. Shape conventions:

* ``B`` -- batch of sequences, ``T`` -- response tokens (right-padded),
* ``mask`` -- float or bool ``[B, T]``, 1 for real response tokens,
* ``logprobs`` -- log pi(a_t | s_t) of the sampled tokens, ``[B, T]``.

Per-token losses aggregate by ``agg`` (`aggregate`): ``token-mean`` (one masked mean over all
valid tokens of the batch), ``seq-mean-token-mean`` (each row's token mean, then the mean over
rows) or ``seq-mean-token-sum-norm`` (each row's token sum over a constant ``norm``, then the mean
over rows: Dr. GRPO's loss, without length weighting). The training engine weights micro-batches
by the aggregation's unit (tokens or rows; `flowrl.algorithms.ops.loss_unit`), so a loss split into micro-batches has
the gradient of the whole mini-batch. Values at padded positions are replaced by 0 before any
nonlinearity, so garbage there (even inf/NaN) affects neither the loss nor its gradients.
Stats dicts hold plain python floats, computed without gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowrl.algorithms.advantages import masked_mean

__all__ = [
    "AGGREGATIONS",
    "KL_KINDS",
    "aggregate",
    "kl_penalty",
    "behaviour_weights",
    "ppo_policy_loss",
    "value_loss",
]

KL_KINDS = ("k1", "k2", "k3")
#: ``algo.loss_agg``'s values: how a per-token loss becomes one number (see `aggregate`).
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(loss_tok: Tensor, mask: Tensor, agg: str = "token-mean", norm: float | None = None) -> Tensor:
    """One number from per-token values ``loss_tok`` [B, T] over ``mask``'s tokens:

    token-mean               sum_{b,t} m*l / sum_{b,t} m
    seq-mean-token-mean      mean_b ( sum_t m*l / sum_t m )          (a row without tokens counts 0)
    seq-mean-token-sum-norm  mean_b ( sum_t m*l / norm )             (Dr. GRPO; norm: the response budget)
    """
    m = _as_bool(mask)
    if agg == "token-mean":
        return masked_mean(loss_tok, m)
    rows = max(loss_tok.shape[0], 1)
    if agg == "seq-mean-token-mean":
        return masked_mean(loss_tok, m, dim=-1).sum() / rows
    if agg == "seq-mean-token-sum-norm":
        if not norm or norm <= 0:
            raise ValueError(f"loss_agg 'seq-mean-token-sum-norm' needs a positive norm, got {norm!r}")
        return _zero_pad(loss_tok, m).sum() / (norm * rows)
    raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGGREGATIONS)}")


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _zero_pad(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman, "Approximating KL").

    x  = log pi(a) - log ref(a)
    k1 = x                       (unbiased, high variance, can be negative)
    k2 = 0.5 * x^2               (biased, low variance)
    k3 = exp(-x) - 1 + x         (unbiased, low variance, always >= 0)
    """
    x = logprobs - ref_logprobs
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x**2
    if kind == "k3":
        return torch.exp(-x) - 1.0 + x
    raise ValueError(f"unknown KL estimator kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
    agg: str = "token-mean",
    norm: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped PPO surrogate loss, aggregated by ``agg`` (`aggregate`; token-mean by default).

    ``weights`` ([B, T], no gradient): a per-token factor on loss_t, e.g. the importance weight
    between the proximal policy (``old_logprobs``) and the behaviour policy that sampled the
    token (decoupled PPO); 0 drops a token from the sum but not from the token count.

    ratio  = exp(logprobs - old_logprobs)
    pg1    = -A * ratio
    pg2    = -A * clip(ratio, 1 - clip_low, 1 + clip_high)     (clip_high > clip_low: DAPO clip-higher)
    loss_t = max(pg1, pg2)
    if dual_clip = c (c > 1, Ye et al. 2020), for tokens with A < 0:
        loss_t = min(loss_t, -c * A)
    loss   = aggregate(loss_t, mask, agg, norm)                 (token-mean: over the whole batch)

    ``advantages``: ``[B, T]`` (token-level) or anything broadcastable to it.
    Stats: ``clipfrac`` (fraction of valid tokens where pg2 > pg1, i.e. clipping
    changed the loss), ``approx_kl`` (masked mean of 0.5 * (logprobs - old)^2),
    ``ratio_mean`` (masked mean of ratio).
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    m = _as_bool(mask)
    advantages = torch.broadcast_to(advantages, logprobs.shape).to(logprobs.dtype)
    log_ratio = _zero_pad(logprobs - old_logprobs, m)
    adv = _zero_pad(advantages, m)

    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(pg1, pg2)
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, pg3), loss_tok)
    if weights is not None:
        loss_tok = loss_tok * _zero_pad(weights.to(loss_tok.dtype), m)
    loss = aggregate(loss_tok, m, agg, norm)

    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg2 > pg1).to(logprobs.dtype), m).item(),
            "approx_kl": masked_mean(0.5 * log_ratio**2, m).item(),
            "ratio_mean": masked_mean(ratio, m).item(),
        }
    return loss, stats


def behaviour_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    versions: Tensor,
    version: int,
    mask: Tensor,
    correction: str = "clip",
    cap: float = 5.0,
) -> tuple[Tensor, dict[str, float]]:
    """Importance weights pi_prox / pi_behav for tokens sampled by older weights (decoupled PPO,
    as AReaL): tokens whose ``versions`` entry equals the policy's ``version`` are on-policy and
    weigh exactly 1; the others weigh exp(old - behaviour), clipped at ``cap`` (``clip``), or 0
    (``mask``: off-policy tokens dropped), or 1 (``none``).

    Stats: ``offpolicy_frac`` (fraction of valid tokens sampled by older weights), ``is_mean`` and
    ``is_max`` (over valid tokens, before clipping), ``is_clipfrac`` (tokens whose weight was changed).
    """
    m = _as_bool(mask)
    stale = m & (versions.to(old_logprobs.device) != version)
    raw = torch.exp(_zero_pad(old_logprobs - behaviour_logprobs.to(old_logprobs.dtype), stale))
    raw = torch.where(stale, raw, torch.ones_like(raw))
    if correction == "clip":
        w = torch.clamp(raw, max=cap)
    elif correction == "mask":
        w = torch.where(stale, torch.zeros_like(raw), raw)
    elif correction == "none":
        w = torch.ones_like(raw)
    else:
        raise ValueError(f"unknown importance-weight correction {correction!r}; valid: clip, mask, none")
    valid = m.to(raw.dtype)
    stats = {
        "offpolicy_frac": masked_mean(stale.to(raw.dtype), m).item(),
        "is_mean": masked_mean(raw, m).item(),
        "is_max": float((raw * valid).max()) if bool(m.any()) else 1.0,
        "is_clipfrac": masked_mean((w != raw).to(raw.dtype), m).item(),
    }
    return w.detach(), stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.2,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value-function loss, token-mean aggregated.

    V_clip = clip(V, V_old - clip, V_old + clip)
    loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)      (clip=None: 0.5 * (V - R)^2)
    loss   = masked_mean(loss_t, mask)

    Stats: ``vf_clipfrac`` (fraction of valid tokens where the clipped term was
    larger, i.e. taken), ``value_mean`` (masked mean of V).
    """
    m = _as_bool(mask)
    v = _zero_pad(values, m)
    v_old = _zero_pad(old_values.to(values.dtype), m)
    ret = _zero_pad(returns.to(values.dtype), m)

    vf1 = (v - ret) ** 2
    if clip is None:
        loss_tok = vf1
        clipped_taken = torch.zeros_like(vf1)
    else:
        v_clipped = v_old + torch.clamp(v - v_old, -clip, clip)
        vf2 = (v_clipped - ret) ** 2
        loss_tok = torch.maximum(vf1, vf2)
        clipped_taken = (vf2 > vf1).to(values.dtype)
    loss = 0.5 * masked_mean(loss_tok, m)

    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean(clipped_taken, m).item(),
            "value_mean": masked_mean(v, m).item(),
        }
    return loss, stats
