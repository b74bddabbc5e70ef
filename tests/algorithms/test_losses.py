"""Tests for flowrl.algorithms.losses against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algorithms.losses import kl_penalty, ppo_policy_loss, value_loss


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def logp_for_ratio(ratios):
    """logprobs such that exp(logprobs - 0) equals the given ratios (old_logprobs = 0)."""
    return torch.log(torch.tensor(ratios))


# --------------------------------------------------------------------------- kl


def test_kl_estimators_hand_values():
    ref = torch.tensor([0.0, -1.0, 0.5, -3.0])
    x = torch.tensor([0.0, 1.0, -1.0, 2.0])
    logp = ref + x
    close(kl_penalty(logp, ref, "k1"), [0.0, 1.0, -1.0, 2.0])
    close(kl_penalty(logp, ref, "k2"), [0.0, 0.5, 0.5, 2.0])
    # exp(-x) - 1 + x: [0, e^-1, e - 2, e^-2 + 1]
    close(kl_penalty(logp, ref, "k3"), [0.0, 0.3678794, 0.7182818, 1.1353353])
    close(kl_penalty(logp, ref), kl_penalty(logp, ref, "k3"))


def test_k3_nonnegative():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * 3
    assert (kl_penalty(x, torch.zeros_like(x), "k3") >= 0).all()


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


# --------------------------------------------------------------------------- ppo


def test_ppo_unclipped_equals_minus_adv_ratio():
    logp = logp_for_ratio([[1.1, 0.9]])
    adv = torch.tensor([[1.0, -2.0]])
    loss, stats = ppo_policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp))
    # per token -A*ratio = [-1.1, 1.8] -> mean 0.35
    close(loss, 0.35)
    assert stats["clipfrac"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0)


def test_ppo_clipped_positive_and_negative_advantage():
    logp = logp_for_ratio([[1.5, 0.5, 0.5, 1.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, stats = ppo_policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp))
    # A>0, r=1.5: max(-1.5, -1.2) = -1.2 (clipped)
    # A>0, r=0.5: max(-0.5, -0.8) = -0.5
    # A<0, r=0.5: max(0.5, 0.8)   =  0.8 (clipped)
    # A<0, r=1.5: max(1.5, 1.2)   =  1.5
    close(loss, (-1.2 - 0.5 + 0.8 + 1.5) / 4)  # 0.15
    assert stats["clipfrac"] == pytest.approx(0.5)


def test_ppo_clip_higher_asymmetry():
    logp = logp_for_ratio([[1.25]])
    old = torch.zeros_like(logp)
    adv = torch.ones_like(logp)
    mask = torch.ones_like(logp)
    sym, sym_stats = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    asym, asym_stats = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(sym, -1.2)
    close(asym, -1.25)
    assert sym_stats["clipfrac"] == 1.0 and asym_stats["clipfrac"] == 0.0
    # the lower bound still uses clip_low: A<0, r=0.75 -> max(0.75, 0.8) = 0.8
    low, _ = ppo_policy_loss(logp_for_ratio([[0.75]]), old, -adv, mask, clip_low=0.2, clip_high=0.28)
    close(low, 0.8)


def test_ppo_dual_clip_caps_negative_advantages():
    logp = logp_for_ratio([[5.0, 2.0, 5.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    plain, _ = ppo_policy_loss(logp, old, adv, mask)
    # [max(5, 1.2), max(2, 1.2), max(-5, -1.2)] = [5, 2, -1.2]
    close(plain, (5.0 + 2.0 - 1.2) / 3)
    dual, _ = ppo_policy_loss(logp, old, adv, mask, dual_clip=3.0)
    # first token capped at -c*A = 3; second (2 < 3) and positive-A token unchanged
    close(dual, (3.0 + 2.0 - 1.2) / 3)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_ppo_dual_clip_must_exceed_one(c):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        ppo_policy_loss(x, x, x, torch.ones_like(x), dual_clip=c)


def test_ppo_masking_clipfrac_and_stats():
    # row 0 has 2 valid tokens, row 1 has 1; padded entries hold junk (inf ratio, huge adv)
    logp = torch.tensor([[0.2, -0.4, 1000.0], [math.log(1.5), 50.0, 7.0]])
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0, 1e6], [1.0, -1e6, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, stats = ppo_policy_loss(logp, old, adv, mask)
    # ratios e^0.2 = 1.2214 (clip -> 1.2), e^-0.4 = 0.6703 (unclipped, A>0), 1.5 (clip -> 1.2)
    close(loss, (-1.2 - math.exp(-0.4) - 1.2) / 3)
    assert stats["clipfrac"] == pytest.approx(2 / 3)
    assert stats["approx_kl"] == pytest.approx(0.5 * (0.04 + 0.16 + math.log(1.5) ** 2) / 3)
    assert stats["ratio_mean"] == pytest.approx((math.exp(0.2) + math.exp(-0.4) + 1.5) / 3)
    assert all(isinstance(v, float) for v in stats.values())


def test_ppo_gradient_flows_and_is_finite():
    logp = torch.tensor([[0.1, -0.1, 900.0], [0.05, 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, -1.0, 5.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = ppo_policy_loss(logp, old, adv, mask, dual_clip=3.0)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    # unclipped tokens: d/dlogp of -A*exp(logp)/3 = -A*ratio/3; padding gets no gradient
    close(logp.grad, [[-math.exp(0.1) / 3, math.exp(-0.1) / 3, 0.0], [2 * math.exp(0.05) / 3, 0.0, 0.0]])


# --------------------------------------------------------------------------- value loss


def test_value_loss_clipped_vs_unclipped():
    values = torch.tensor([[1.0, 2.0, 2.0]])
    old = torch.tensor([[0.8, 1.0, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 3.0]])
    mask = torch.ones(1, 3)
    # token 0: V inside [0.6, 1.0] -> 0.5 * 1 = 0.5
    # token 1: clip -> 1.2; max(4, 1.44) = 4 -> 2.0 (unclipped term)
    # token 2: clip -> 1.2; max(1, 3.24) = 3.24 -> 1.62 (clipped term taken)
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    close(loss, (0.5 + 2.0 + 1.62) / 3)
    assert stats["vf_clipfrac"] == pytest.approx(1 / 3)
    assert stats["value_mean"] == pytest.approx(5 / 3)
    loss_u, stats_u = value_loss(values, old, returns, mask, clip=None)
    close(loss_u, (0.5 + 2.0 + 0.5) / 3)
    assert stats_u["vf_clipfrac"] == 0.0


def test_value_loss_masking_and_grad():
    values = torch.tensor([[1.0, 5.0], [2.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    returns = torch.tensor([[3.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 0], [1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip=0.5)
    # token (0,0): max(4, (1.5-3)^2=2.25) = 4 -> 2 ; token (1,0): max(1, (1.5-1)^2=0.25) = 1 -> 0.5
    close(loss, (2.0 + 0.5) / 2)
    assert stats["value_mean"] == pytest.approx(1.5)
    loss.backward()
    # d/dV of 0.5*(V-R)^2 / 2 = (V-R)/2
    close(values.grad, [[-1.0, 0.0], [0.5, 0.0]])
