"""Tests for flowrl.algorithms.advantages against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algorithms.advantages import (
    broadcast_to_tokens,
    gae,
    grpo,
    masked_mean,
    masked_whiten,
    reinforce_pp,
    remax,
    rloo,
    sequence_to_token_rewards,
)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --------------------------------------------------------------------------- masked_mean / whiten


def test_masked_mean_scalar_and_dims():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 7.0 / 3.0)  # (1 + 2 + 4) / 3
    close(masked_mean(x, mask, dim=1), [1.5, 4.0])
    close(masked_mean(x, mask, dim=0), [2.5, 2.0, 0.0])  # empty column -> 0, not NaN


def test_masked_mean_ignores_nan_in_padding_and_bool_mask():
    x = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    mask = torch.tensor([[True, False], [True, False]])
    close(masked_mean(x, mask), 2.0)


def test_masked_whiten_hand_values():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2, population var 2/3, std 0.8164966
    close(masked_whiten(x, mask), [-1.2247449, 0.0, 1.2247449, 0.0])
    close(masked_whiten(x, mask, shift_mean=False), [0.7752551, 2.0, 3.2247449, 0.0])


# --------------------------------------------------------------------------- gae


def test_gae_two_lengths_hand_values():
    # row 0: length 3, row 1: length 2 (last column is padding with junk)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 2.0, 99.0]])
    values = torch.tensor([[0.5, 0.5, 0.5], [1.0, 2.0, 77.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # row 0: deltas = [-0.25, -0.25, 0.5]; A2 = 0.5, A1 = -0.25 + 0.25*0.5 = -0.125,
    #        A0 = -0.25 + 0.25*(-0.125) = -0.28125
    # row 1: delta1 = 2 + 0 - 2 = 0, delta0 = 1 + 0.5*2 - 1 = 1; A = [1, 0]
    close(adv, [[-0.28125, -0.125, 0.5], [1.0, 0.0, 0.0]])
    close(ret, [[0.21875, 0.375, 1.0], [2.0, 2.0, 0.0]])


def test_gae_padding_does_not_change_valid_results():
    rewards = torch.tensor([[0.3, -0.2, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.4, 0.2, 0.0], [1.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv_a, ret_a = gae(rewards, values, mask, gamma=0.9, lam=0.8)

    junk_r = rewards.clone()
    junk_v = values.clone()
    junk_r[mask == 0] = 123.0
    junk_v[mask == 0] = -55.0
    adv_b, ret_b = gae(junk_r, junk_v, mask, gamma=0.9, lam=0.8)
    close(adv_b, adv_a)
    close(ret_b, ret_a)

    # row 1 alone, unpadded, gives the same numbers
    adv_c, ret_c = gae(rewards[1:, :2], values[1:, :2], mask[1:, :2], gamma=0.9, lam=0.8)
    close(adv_a[1:, :2], adv_c)
    close(ret_a[1:, :2], ret_c)
    assert (adv_a[mask == 0] == 0).all() and (ret_a[mask == 0] == 0).all()


def test_gae_lam_one_returns_are_discounted_sum():
    rewards = torch.tensor([[1.0, 2.0, 4.0]])
    values = torch.tensor([[3.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    # G = [1 + 0.5*2 + 0.25*4, 2 + 0.5*4, 4] = [3, 4, 4]
    close(ret, [[3.0, 4.0, 4.0]])
    close(adv, [[0.0, 5.0, 2.0]])


def test_gae_gamma_zero_and_lam_zero():
    rewards = torch.tensor([[1.0, 2.0, 4.0]])
    values = torch.tensor([[3.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    # gamma = 0: A_t = r_t - V_t
    adv, ret = gae(rewards, values, mask, gamma=0.0, lam=0.95)
    close(adv, [[-2.0, 3.0, 2.0]])
    close(ret, [[1.0, 2.0, 4.0]])
    # lam = 0: A_t = delta_t = r_t + V_{t+1} - V_t (gamma = 1)
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=0.0)
    close(adv, [[1.0 - 1.0 - 3.0, 2.0 + 2.0 + 1.0, 4.0 - 2.0]])


# --------------------------------------------------------------------------- grpo / rloo / remax


def test_grpo_unsorted_noncontiguous_groups_and_singleton():
    scores = torch.tensor([6.0, 1.0, 0.0, 3.0, 3.0, 7.0])
    group = torch.tensor([4, 9, 4, 9, 4, 2])
    # group 4 = {6, 0, 3}: mean 3, unbiased std 3 -> [1, -1, 0]
    # group 9 = {1, 3}: mean 2, unbiased std sqrt(2) -> [-1/sqrt2, 1/sqrt2]
    # group 2 = {7}: singleton -> 0
    s = 1 / math.sqrt(2)
    close(grpo(scores, group, eps=0.0), [1.0, -s, -1.0, s, 0.0, 0.0])
    close(grpo(scores, group), [1.0, -s, -1.0, s, 0.0, 0.0], atol=1e-5)
    close(grpo(scores, group, scale=False), [3.0, -1.0, -3.0, 1.0, 0.0, 0.0])
    assert torch.isfinite(grpo(torch.tensor([5.0]), torch.tensor([0]), eps=0.0)).all()


def test_grpo_constant_group_is_zero():
    adv = grpo(torch.tensor([2.0, 2.0, 2.0]), torch.tensor([1, 1, 1]))
    close(adv, [0.0, 0.0, 0.0])


def test_rloo_hand_values():
    scores = torch.tensor([5.0, 1.0, 9.0, 2.0, 8.0, 6.0])
    group = torch.tensor([11, 0, 3, 0, 11, 0])
    # group 0 = {1, 2, 6}: 1 - 4 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5
    # group 11 = {5, 8}: -3, 3; group 3 = {9}: 0
    close(rloo(scores, group), [-3.0, -3.0, 0.0, -1.5, 3.0, 4.5])


def test_remax():
    close(remax(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.5, 0.5, 0.5])), [0.5, -0.5, 0.0])


# --------------------------------------------------------------------------- reinforce++


def test_reinforce_pp_hand_values_and_zero_mean():
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = reinforce_pp(token_rewards, mask, gamma=1.0)
    # G = [[1, 1, 1], [2, 2, -]]: mean 1.4, population std sqrt(0.24) = 0.4898979
    a, b = -0.4 / math.sqrt(0.24), 0.6 / math.sqrt(0.24)  # -0.8164966, 1.2247449
    close(adv, [[a, a, a], [b, b, 0.0]])
    close(masked_mean(adv, mask), 0.0)


def test_reinforce_pp_discount():
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = reinforce_pp(token_rewards, mask, gamma=0.5)
    # G = [[0.25, 0.5, 1], [1, 2, -]]: mean 0.95,
    # var = (0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025) / 5 = 0.36
    close(adv, [[-0.7 / 0.6, -0.45 / 0.6, 0.05 / 0.6], [0.05 / 0.6, 1.05 / 0.6, 0.0]])
    close(masked_mean(adv, mask), 0.0)


# --------------------------------------------------------------------------- helpers


def test_sequence_to_token_rewards():
    scores = torch.tensor([3.0, -1.0, 2.0, 7.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    out = sequence_to_token_rewards(scores, mask)
    close(out, [[0.0, 0.0, 3.0], [0.0, -1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_broadcast_to_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    close(broadcast_to_tokens(torch.tensor([0.5, -2.0]), mask), [[0.5, 0.5, 0.0], [-2.0, 0.0, 0.0]])
    close(broadcast_to_tokens(torch.tensor([0.5, -2.0]), mask.bool()), [[0.5, 0.5, 0.0], [-2.0, 0.0, 0.0]])


def test_inputs_not_modified():
    rewards = torch.tensor([[1.0, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    r0, v0 = rewards.clone(), values.clone()
    gae(rewards, values, mask)
    reinforce_pp(rewards, mask)
    assert torch.equal(rewards, r0) and torch.equal(values, v0)


@pytest.mark.parametrize("fn", [grpo, rloo])
def test_group_estimators_grad_free_of_nan(fn):
    # groups: {1, 2} normal, {3} singleton, {4, 4} constant
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0], requires_grad=True)
    (fn(scores, torch.tensor([0, 0, 1, 2, 2])) * torch.arange(5.0)).sum().backward()
    assert torch.isfinite(scores.grad).all()
