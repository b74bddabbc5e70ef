"""SimPO (Meng et al., 2024) as a plugin's preference loss: reference-free, length-normalised, with a
target margin. Each response's implicit reward is ``beta`` times its mean log-prob per trained token,
and the loss of a pair is ``-log sigmoid(r_chosen - r_rejected - target_margin)`` (with ``label_smoothing``
the chance a label is flipped, as cDPO). No reference model: the graph is the data's pairs and one
train node. Registered with ``rows="pairs"``: the engine keeps each pair (rows 2i chosen, 2i+1
rejected, from a ``g.source(..., rows="pairs")`` node) in one micro-batch."""

from __future__ import annotations

from typing import Any

from flowrl.contract import Graph

#: the algorithm's config: preference columns of the user's file (--data), no verifier, no KL
DEFAULTS = {
    "data": {"chosen_key": "chosen", "rejected_key": "rejected", "verifier": "none"},
    "algo": {"kl_coef": 0.0},
}


def simpo_loss(
    logprobs: Any, batch: Any, algo: Any, *, beta: float = 2.0, target_margin: float = 1.0, label_smoothing: float = 0.0
) -> tuple[Any, dict[str, float]]:
    """The mean over pairs of -(1-e) log sigmoid(h) - e log sigmoid(-h), h = r_chosen - r_rejected - target_margin,
    r = beta * (mean log-prob of the response's trained tokens)."""
    import torch
    import torch.nn.functional as F

    from flowrl.contract import pair_rows, sequences_in

    if beta <= 0 or not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"loss 'simpo' needs beta > 0 and label_smoothing in [0, 0.5), got {beta}, {label_smoothing}")
    seqs = sequences_in(batch, "loss 'simpo'")
    chosen, rejected = pair_rows(seqs, "loss 'simpo'")
    mask = seqs.sampled_mask.to(logprobs.dtype)
    summed = (logprobs * mask).sum(-1)
    reward = beta * summed / mask.sum(-1).clamp_min(1.0)
    h = reward[chosen] - reward[rejected] - target_margin
    loss = (-(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)).mean()
    with torch.no_grad():
        rc, rr = reward[chosen].detach(), reward[rejected].detach()
        stats = {
            "reward_chosen": float(rc.mean()),
            "reward_rejected": float(rr.mean()),
            "margin": float((rc - rr).mean()),
            "pref_accuracy": float((rc > rr).float().mean()),
            "logp_chosen": float(summed[chosen].detach().mean()),
            "logp_rejected": float(summed[rejected].detach().mean()),
        }
    return loss, stats


def build_simpo(cfg: Any) -> Graph:
    g = Graph("simpo")
    g.model("actor", "actor")
    g.source("data", reads="prompts", writes="responses", rows="pairs")
    g.train("train_actor", model="actor", loss="simpo", reads="responses", beta=2.0, target_margin=1.0)
    return g
