"""Advantage estimators for RL post-training of LLMs.

Plain tensor functions, no state. Shape conventions:

* ``B`` -- batch of sequences (one row per sampled response),
* ``T`` -- response tokens (right-padded to a common length),
* ``mask`` -- float or bool ``[B, T]``, 1 for real response tokens, 0 for padding.

Sequence-level estimators (``grpo``, ``rloo``, ``remax``) take one scalar score
per sequence (``[B]``) and return ``[B]``; use :func:`broadcast_to_tokens` to
turn them into per-token advantages. Token-level estimators (``gae``,
``reinforce_pp``) take ``[B, T]`` rewards and return ``[B, T]`` tensors that are
0 on padding.

All functions are pure: they do not modify their inputs. Nothing here detaches
gradients; callers usually compute advantages under ``torch.no_grad()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "masked_mean",
    "masked_whiten",
    "gae",
    "grpo",
    "rloo",
    "remax",
    "reinforce_pp",
    "sequence_to_token_rewards",
    "broadcast_to_tokens",
]


def _as_bool(mask: Tensor) -> Tensor:
    """Mask as a bool tensor (nonzero = valid)."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1.

    mean = sum(x * m) / sum(m)

    ``dim=None`` reduces everything to a scalar; otherwise reduces ``dim``.
    Values at masked positions never leak in (not even NaN/inf). A slice with
    no valid entry gives 0 instead of NaN.
    """
    m = _as_bool(mask)
    xm = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    count = m.to(x.dtype)
    if dim is None:
        return xm.sum() / count.sum().clamp_min(1.0)
    return xm.sum(dim) / count.sum(dim).clamp_min(1.0)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize ``x`` with the mean / std of its valid entries.

    mu = masked_mean(x), var = masked_mean((x - mu)^2)   (population variance, unbiased=False)
    out = (x - mu) / sqrt(var + eps)          if shift_mean
    out = (x - mu) / sqrt(var + eps) + mu     otherwise (rescale only, keep the mean)

    Masked positions of the result are 0.
    """
    m = _as_bool(mask)
    mu = masked_mean(x, m)
    var = masked_mean((x - mu) ** 2, m)
    out = (x - mu) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mu
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016) over response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t          (V_{t+1} = 0 past the last valid token)
    A_t     = delta_t + gamma * lam * A_{t+1}      (A = 0 past the last valid token)
    R_t     = A_t + V_t

    ``rewards``, ``values``, ``mask``: ``[B, T]``, responses right-padded.
    Returns ``(advantages, returns)``, both ``[B, T]`` and 0 where ``mask`` is 0,
    so padding never leaks into valid positions. With ``lam=1`` the returns are
    the discounted reward-to-go. No whitening here (see :func:`masked_whiten`).
    """
    m = _as_bool(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    r = torch.where(m, rewards.to(values.dtype), zero)
    v = torch.where(m, values, zero)

    T = r.shape[-1]
    next_value = torch.zeros_like(v[..., 0])
    next_adv = torch.zeros_like(v[..., 0])
    advs_reversed = []
    for t in reversed(range(T)):
        delta = r[..., t] + gamma * next_value - v[..., t]
        adv_t = torch.where(m[..., t], delta + gamma * lam * next_adv, zero)
        advs_reversed.append(adv_t)
        next_value = v[..., t]
        next_adv = adv_t
    advantages = torch.stack(advs_reversed[::-1], dim=-1)
    returns = torch.where(m, advantages + v, zero)
    return advantages, returns


def _group_index(group: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids (unsorted, non-contiguous) to 0..G-1."""
    _, inverse = torch.unique(group, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() > 0 else 0
    return inverse, num_groups


def _group_sum(x: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """Per-group sum of ``x``, gathered back to ``[B]``."""
    sums = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add(0, index, x)
    return sums[index]


def grpo(scores: Tensor, group: Tensor, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """Group-relative advantages (GRPO, Shao et al., 2024).

    A_i = (r_i - mean_g) / (std_g + eps)    if scale
    A_i =  r_i - mean_g                     otherwise

    ``scores``: ``[B]`` one scalar per sequence; ``group``: ``[B]`` ids, samples
    of the same prompt share an id (any order, any values). ``std_g`` is the
    unbiased std (n - 1 in the denominator, as ``torch.std`` / TRL). A group
    with a single sample gets advantage 0.
    """
    r = scores.to(torch.get_default_dtype()) if not scores.is_floating_point() else scores
    idx, G = _group_index(group)
    n = _group_sum(torch.ones_like(r), idx, G)
    mean = _group_sum(r, idx, G) / n
    centered = r - mean
    if not scale:
        return centered
    var = _group_sum(centered**2, idx, G) / (n - 1).clamp_min(1.0)
    # sqrt has an infinite gradient at 0 (constant or singleton group): keep it out of autograd
    positive = var > 0
    std = torch.where(positive, torch.where(positive, var, torch.ones_like(var)).sqrt(), torch.zeros_like(var))
    adv = centered / (std + eps)
    return torch.where(n > 1, adv, torch.zeros_like(adv))


def rloo(scores: Tensor, group: Tensor) -> Tensor:
    """REINFORCE Leave-One-Out advantages (Kool et al., 2019; Ahmadian et al., 2024).

    b_i = (sum_g - r_i) / (n_g - 1)      (mean of the *other* samples of the group)
    A_i = r_i - b_i

    ``scores``, ``group``: ``[B]`` as in :func:`grpo`. A group of size 1 gets 0.
    """
    r = scores.to(torch.get_default_dtype()) if not scores.is_floating_point() else scores
    idx, G = _group_index(group)
    n = _group_sum(torch.ones_like(r), idx, G)
    total = _group_sum(r, idx, G)
    baseline = (total - r) / (n - 1).clamp_min(1.0)
    adv = r - baseline
    return torch.where(n > 1, adv, torch.zeros_like(adv))


def remax(scores: Tensor, baseline_scores: Tensor) -> Tensor:
    """ReMax advantages (Li et al., 2023): greedy-decoding reward as baseline.

    A_i = r_i - b_i,   b_i = reward of the greedy response to the same prompt

    ``scores``, ``baseline_scores``: ``[B]`` (baseline already broadcast per sample).
    """
    return scores - baseline_scores


def reinforce_pp(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ advantages (Hu, 2025): discounted return, whitened over the batch.

    G_t = sum_{k >= t} gamma^(k - t) r_k      (over valid tokens of the same sequence)
    A   = masked_whiten(G, mask)             (global batch normalization)

    ``token_rewards``: ``[B, T]`` (e.g. the sequence score on the last token,
    minus a per-token KL penalty); responses right-padded. Returns ``[B, T]``,
    0 on padding.
    """
    m = _as_bool(mask)
    dtype = token_rewards.dtype if token_rewards.is_floating_point() else torch.get_default_dtype()
    zero = torch.zeros((), dtype=dtype, device=token_rewards.device)
    r = torch.where(m, token_rewards.to(dtype), zero)

    running = torch.zeros_like(r[..., 0])
    returns_reversed = []
    for t in reversed(range(r.shape[-1])):
        running = torch.where(m[..., t], r[..., t] + gamma * running, zero)
        returns_reversed.append(running)
    returns = torch.stack(returns_reversed[::-1], dim=-1)
    return masked_whiten(returns, m)


def sequence_to_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Put each sequence's scalar score on its last valid token.

    out[b, t] = scores[b]  if t == last valid index of row b,  else 0

    ``scores``: ``[B]``; ``mask``: ``[B, T]``. Rows without valid tokens stay 0.
    """
    m = _as_bool(mask)
    B, T = m.shape
    dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    positions = torch.arange(1, T + 1, device=m.device).expand(B, T)
    # index of the last valid token: argmax of (t + 1) * m (0 everywhere invalid)
    last = torch.where(m, positions, torch.zeros_like(positions)).argmax(dim=-1)
    out = torch.zeros(B, T, dtype=dtype, device=scores.device)
    out = out.scatter(1, last.unsqueeze(-1), scores.to(dtype).unsqueeze(-1))
    return out * m.any(dim=-1, keepdim=True).to(dtype)


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Copy a per-sequence advantage onto every valid token.

    out[b, t] = adv[b] * m[b, t]

    ``adv``: ``[B]``; ``mask``: ``[B, T]`` -> ``[B, T]``.
    """
    return adv.unsqueeze(-1) * mask.to(adv.dtype)
