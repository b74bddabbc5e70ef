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
    "MISMATCH_MODES",
    "mismatch_weights",
    "sequence_mismatch_weights",
    "ppo_policy_loss",
    "value_loss",
    "PREFERENCE_LOSSES",
    "preference_loss",
    "dpo_loss",
    "pair_stats",
    "bradley_terry_loss",
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


#: ``algo.mismatch``'s values: a token part (``tis`` or ``icepop``), a sequence part (``seq-mask``), or both.
MISMATCH_MODES = ("none", "tis", "icepop", "seq-mask", "tis+seq-mask", "icepop+seq-mask")


def _mismatch_parts(mode: str) -> tuple[str | None, bool]:
    """(token part: ``tis``, ``icepop`` or None; whether rows are masked by their geometric mean)."""
    if mode not in MISMATCH_MODES:
        raise ValueError(f"unknown sampler/trainer mismatch correction {mode!r}; valid: {', '.join(MISMATCH_MODES)}")
    parts = mode.split("+")
    token = next((p for p in parts if p in ("tis", "icepop")), None)
    return token, "seq-mask" in parts


def _log_mismatch(old_logprobs: Tensor, behaviour_logprobs: Tensor, m: Tensor) -> Tensor:
    """log r = old - behaviour at valid tokens, 0 (r = 1) at padding."""
    return _zero_pad(old_logprobs - behaviour_logprobs.to(old_logprobs.device, old_logprobs.dtype), m)


def _row_log_mismatch(log_r: Tensor, m: Tensor) -> Tensor:
    """Each row's mean log r over its valid tokens: the log of the geometric mean ratio (0 for an empty row)."""
    return log_r.sum(-1) / m.sum(-1).clamp_min(1).to(log_r.dtype)


def _ratio_stats(log_r: Tensor, m: Tensor) -> dict[str, float]:
    r = torch.exp(log_r)
    some = bool(m.any())
    return {
        "mismatch_gap": masked_mean(log_r.abs(), m).item(),
        "mismatch_ratio_mean": masked_mean(r, m).item() if some else 1.0,
        "mismatch_ratio_min": float(r[m].min()) if some else 1.0,
        "mismatch_ratio_max": float(r[m].max()) if some else 1.0,
    }


@torch.no_grad()
def mismatch_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    mode: str = "tis",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    seq_low: float = 0.99,
    seq_high: float = 1.01,
    stale: Tensor | None = None,
    stale_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights correcting the gap between the sampler (behaviour log-probs, e.g. a bf16
    vLLM engine) and the trainer (``old_logprobs``, the proximal policy's), composed with the
    staleness weights of `behaviour_weights` so that each token's ratio counts once:

        r_t   = exp(old_t - behaviour_t)                               (one ratio per token)
        w_t   = stale_weights_t                  for stale tokens (``stale``: sampled by older weights;
                                                 their weight already is r_t, clipped by algo.is_cap)
              = min(r_t, cap)  (tis) | r_t  (icepop) | 1  (otherwise)            for the other tokens
        icepop:   w_t *= [low <= r_t <= high]                          (every token, stale ones too)
        seq-mask: w_t *= [seq_low <= exp(mean_t' log r_t') <= seq_high]  (the row's geometric mean)

    So staleness correction owns version drift (its tokens' truncation is ``is_cap``), the mismatch
    correction owns numeric drift on the current version's tokens, and its masks reject any token
    or row whose ratio is out of bounds. ``mode`` ``none`` gives the staleness weights unchanged.
    Without ``stale``, every token is of the current version. Masked tokens weigh 0: they leave
    the loss's sum but not its token count.

    Stats (over valid tokens): ``mismatch_gap`` (mean |old - behaviour|), ``mismatch_ratio_mean``,
    ``_min`` and ``_max`` (of r), ``mismatch_truncfrac`` (tokens TIS truncated), ``mismatch_maskfrac``
    (tokens masked by icepop or seq-mask), ``mismatch_seq_maskfrac`` (rows seq-mask rejected).
    """
    token, by_row = _mismatch_parts(mode)
    m = _as_bool(mask)
    log_r = _log_mismatch(old_logprobs, behaviour_logprobs, m)
    r = torch.exp(log_r)
    one = torch.ones_like(r)
    truncated = torch.zeros_like(m)
    if token == "tis":
        w = torch.clamp(r, max=cap)
        truncated = m & (r > cap)
    elif token == "icepop":
        w = r
    else:
        w = one
    if stale is not None:
        stale = m & stale.to(m.device)
        truncated = truncated & ~stale
        w = torch.where(stale, one if stale_weights is None else stale_weights.to(r.dtype), w)
    keep = torch.ones_like(m)
    if token == "icepop":
        keep = (r >= low) & (r <= high)
    rows_out = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
    if by_row:
        geo = torch.exp(_row_log_mismatch(log_r, m))
        rows_out = ~((geo >= seq_low) & (geo <= seq_high)) & m.any(-1)
        keep = keep & ~rows_out[:, None]
    w = torch.where(keep, w, torch.zeros_like(w))
    rows = m.any(-1)
    stats = _ratio_stats(log_r, m)
    stats.update(
        {
            "mismatch_truncfrac": masked_mean(truncated.to(r.dtype), m).item(),
            "mismatch_maskfrac": masked_mean((~keep).to(r.dtype), m).item(),
            "mismatch_seq_maskfrac": float(rows_out.sum() / rows.sum()) if bool(rows.any()) else 0.0,
        }
    )
    return _zero_pad(w, m).detach(), stats


@torch.no_grad()
def sequence_mismatch_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    mode: str = "tis",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    seq_low: float = 0.99,
    seq_high: float = 1.01,
) -> tuple[Tensor, dict[str, float]]:
    """One weight per row ([B]) for a sequence-level loss (GSPO), from the row's geometric-mean ratio
    rho = exp(mean_t (old_t - behaviour_t)) over its valid tokens (every token: such a loss has no
    separate staleness correction, so rho covers version and numeric drift alike):

        w = min(rho, cap)  (tis) | rho * [low <= rho <= high]  (icepop) | 1  (otherwise)
        seq-mask: w *= [seq_low <= rho <= seq_high]

    Stats: those of `mismatch_weights`, with ``mismatch_truncfrac`` and ``mismatch_maskfrac`` fractions
    of the rows with tokens (truncated; masked by either bound).
    """
    token, by_row = _mismatch_parts(mode)
    m = _as_bool(mask)
    log_r = _log_mismatch(old_logprobs, behaviour_logprobs, m)
    rho = torch.exp(_row_log_mismatch(log_r, m))
    rows = m.any(-1)
    w = torch.ones_like(rho)
    keep = torch.ones_like(rows)
    truncated = torch.zeros_like(rows)
    if token == "tis":
        w, truncated = torch.clamp(rho, max=cap), rows & (rho > cap)
    elif token == "icepop":
        w, keep = rho, (rho >= low) & (rho <= high)
    seq_out = torch.zeros_like(rows)
    if by_row:
        seq_out = rows & ~((rho >= seq_low) & (rho <= seq_high))
        keep = keep & ~seq_out
    keep = keep | ~rows  # a row without tokens has no loss to mask
    w = torch.where(keep, w, torch.zeros_like(w))
    n = rows.sum().clamp_min(1)
    stats = _ratio_stats(log_r, m)
    stats.update(
        {
            "mismatch_truncfrac": float(truncated.sum() / n),
            "mismatch_maskfrac": float((~keep).sum() / n),
            "mismatch_seq_maskfrac": float(seq_out.sum() / n),
        }
    )
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


# ---------------------------------------------------------------- preference losses

#: ``loss_type`` of `preference_loss`: DPO's sigmoid (cDPO with label smoothing), its unbiased robust
#: form, and IPO's squared loss.
PREFERENCE_LOSSES = ("sigmoid", "robust", "ipo")


def preference_loss(margin: Tensor, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> Tensor:
    """Per pair, the loss of ``margin`` h = (log pi/ref of chosen) - (log pi/ref of rejected) [P]:

    sigmoid  -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)             DPO (Rafailov et al. 2023);
                                                                              e > 0: cDPO (labels flipped
                                                                              with probability e)
    robust   (-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) / (1 - 2e)   robust DPO (Chowdhury
                                                                              et al. 2024), e < 0.5
    ipo      (h - 1 / (2 beta))^2                                               IPO (Azar et al. 2023)
    """
    import torch.nn.functional as F

    if beta <= 0:
        raise ValueError(f"a preference loss needs beta > 0, got {beta!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    e = label_smoothing
    if loss_type == "sigmoid":
        return -(1 - e) * F.logsigmoid(beta * margin) - e * F.logsigmoid(-beta * margin)
    if loss_type == "robust":
        return (-(1 - e) * F.logsigmoid(beta * margin) + e * F.logsigmoid(-beta * margin)) / (1 - 2 * e)
    if loss_type == "ipo":
        return (margin - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown preference loss_type {loss_type!r}; valid: {', '.join(PREFERENCE_LOSSES)}")


def dpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """DPO's loss from the policy's and the reference's summed log-probs of each pair's chosen and
    rejected response ([P] each): the mean over pairs of `preference_loss`, and the stats TRL's
    DPOTrainer logs -- the implicit rewards beta * (log pi - log ref) of the chosen and the rejected
    responses (``reward_chosen``, ``reward_rejected``), their difference (``margin``), the fraction of
    pairs whose chosen reward is the higher (``pref_accuracy``) and the policy's log-probs
    (``logp_chosen``, ``logp_rejected``)."""
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    loss = preference_loss(margin, beta, loss_type, label_smoothing).mean()
    with torch.no_grad():
        reward_c = beta * (chosen - ref_chosen).detach()
        reward_r = beta * (rejected - ref_rejected).detach()
        stats = pair_stats(reward_c, reward_r)
        if stats:
            stats |= {"logp_chosen": float(chosen.float().mean()), "logp_rejected": float(rejected.float().mean())}
    return loss, stats


def pair_stats(reward_c: Tensor, reward_r: Tensor) -> dict[str, float]:
    """The stats of a loss over preference pairs from each pair's rewards of its chosen and rejected
    response ([P]): their means (``reward_chosen``, ``reward_rejected``), their difference (``margin``)
    and the fraction of pairs whose chosen reward is the higher (``pref_accuracy``); none for no pair."""
    if not len(reward_c):
        return {}
    mean = lambda t: float(t.float().mean())  # noqa: E731
    return {
        "reward_chosen": mean(reward_c),
        "reward_rejected": mean(reward_r),
        "margin": mean(reward_c - reward_r),
        "pref_accuracy": mean(reward_c > reward_r),
    }


def bradley_terry_loss(
    chosen: Tensor,
    rejected: Tensor,
    margin: Tensor | float = 0.0,
    center_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Bradley-Terry loss of a reward model on preference pairs (Ouyang et al., 2022), a mean over pairs.

    loss = mean_i( -log sigmoid(r_c_i - r_r_i - m_i) ) + center_coef * mean_i( (r_c_i + r_r_i)^2 )

    ``chosen``, ``rejected``: [P] scores of each pair's chosen and rejected response; ``margin``: how
    far the chosen must score above the rejected (a number, or one per pair: Llama 2's margin); the
    centering term (TRL's ``center_rewards_coefficient``, Eisenstein et al., 2023) keeps the scores'
    mean near 0, which the first term alone leaves free.

    Stats: `pair_stats` of the scores (``reward_chosen``, ``reward_rejected``, ``margin``: mean
    r_c - r_r, ``pref_accuracy``: the fraction of pairs with r_c > r_r), as DPO's of its implicit rewards.
    """
    diff = chosen - rejected
    loss = -torch.nn.functional.logsigmoid(diff - margin).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        stats = pair_stats(chosen.detach(), rejected.detach())
    return loss, stats
