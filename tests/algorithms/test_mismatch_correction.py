"""Sampler/trainer mismatch correction (``algo.mismatch``): exact weights of truncated importance
sampling, IcePop token masking and geometric-mean sequence masking on hand-built ratios, their
composition with the staleness weights (each token's ratio counts once), masked tokens left without
gradient, no change at all when the sampler and the trainer agree, the config's bounds refused naming
the field, and a local run that reports the metrics."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch

from flowrl import api
from flowrl.algorithms.losses import behaviour_weights, mismatch_weights, sequence_mismatch_weights
from flowrl.algorithms.ops import gspo_loss, ppo_loss
from flowrl.contract.data import Sequences, StepBatch
from flowrl.errors import ConfigError, FlowRLError
from flowrl.specs import AlgoConfig, algo_problems

LN = math.log
METRICS = (
    "mismatch_gap",
    "mismatch_ratio_mean",
    "mismatch_ratio_min",
    "mismatch_ratio_max",
    "mismatch_truncfrac",
    "mismatch_maskfrac",
    "mismatch_seq_maskfrac",
)


def ratios(*rows: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, behaviour, mask) whose per-token ratio exp(old - behaviour) is each given value; rows
    are right-padded (padding log-probs are garbage, which must not matter)."""
    width = max(len(r) for r in rows)
    old = torch.full((len(rows), width), float("nan"))
    behaviour = torch.full((len(rows), width), float("inf"))
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        for t, r in enumerate(row):
            old[i, t], behaviour[i, t], mask[i, t] = -1.0 + LN(r), -1.0, 1.0
    return old, behaviour, mask


def close(w: torch.Tensor, expected: list[list[float]]) -> bool:
    return torch.allclose(w, torch.tensor(expected), atol=1e-6)


# ------------------------------------------------------------------ token weights in each mode


def test_tis_truncates_the_ratio_at_the_cap_and_keeps_smaller_ones():
    old, behaviour, mask = ratios([0.5, 1.0, 1.5, 3.0], [8.0])
    w, stats = mismatch_weights(old, behaviour, mask, "tis", cap=2.0)
    assert close(w, [[0.5, 1.0, 1.5, 2.0], [2.0, 0.0, 0.0, 0.0]])
    assert stats["mismatch_truncfrac"] == pytest.approx(2 / 5)
    assert stats["mismatch_maskfrac"] == 0.0 and stats["mismatch_seq_maskfrac"] == 0.0
    assert stats["mismatch_ratio_min"] == pytest.approx(0.5) and stats["mismatch_ratio_max"] == pytest.approx(8.0)
    assert stats["mismatch_ratio_mean"] == pytest.approx((0.5 + 1 + 1.5 + 3 + 8) / 5)
    gaps = [abs(LN(r)) for r in (0.5, 1.0, 1.5, 3.0, 8.0)]
    assert stats["mismatch_gap"] == pytest.approx(sum(gaps) / 5)


def test_icepop_weighs_by_the_ratio_inside_the_bounds_and_masks_tokens_outside():
    old, behaviour, mask = ratios([0.25, 0.5, 0.8, 1.5, 2.0, 4.0])
    w, stats = mismatch_weights(old, behaviour, mask, "icepop", low=0.5, high=2.0)
    assert close(w, [[0.0, 0.5, 0.8, 1.5, 2.0, 0.0]])  # the bounds themselves are kept
    assert stats["mismatch_maskfrac"] == pytest.approx(2 / 6) and stats["mismatch_truncfrac"] == 0.0


def test_seq_mask_rejects_whole_responses_by_their_geometric_mean_ratio():
    # geometric means: 1.0 (2 and 0.5 cancel), 1.1, 1.005, 0.9
    old, behaviour, mask = ratios([2.0, 0.5], [1.1, 1.1, 1.1], [1.005], [0.9, 0.9])
    w, stats = mismatch_weights(old, behaviour, mask, "seq-mask", seq_low=0.99, seq_high=1.01)
    assert close(w, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert stats["mismatch_seq_maskfrac"] == pytest.approx(2 / 4)
    assert stats["mismatch_maskfrac"] == pytest.approx(5 / 8)  # the tokens of the rejected rows


def test_tis_with_seq_mask_truncates_the_kept_responses():
    old, behaviour, mask = ratios([4.0, 0.25], [1.2, 1.2])
    w, _ = mismatch_weights(old, behaviour, mask, "tis+seq-mask", cap=2.0)
    assert close(w, [[2.0, 0.25], [0.0, 0.0]])
    w, _ = mismatch_weights(old, behaviour, mask, "icepop+seq-mask", low=0.5, high=2.0)
    assert close(w, [[0.0, 0.0], [0.0, 0.0]])


def test_none_weighs_every_current_token_one():
    old, behaviour, mask = ratios([0.1, 10.0])
    w, stats = mismatch_weights(old, behaviour, mask, "none")
    assert close(w, [[1.0, 1.0]]) and stats["mismatch_ratio_max"] == pytest.approx(10.0)


def test_an_unknown_mode_is_refused_naming_the_valid_ones():
    old, behaviour, mask = ratios([1.0])
    with pytest.raises(ValueError, match="tis, icepop"):
        mismatch_weights(old, behaviour, mask, "tsi")


# ------------------------------------------------------------------ composition with staleness


def test_a_stale_tokens_ratio_counts_once_under_the_staleness_cap():
    """Stale tokens keep is_correction's weight min(r, is_cap): TIS neither multiplies it by r again
    nor truncates it at the smaller mismatch cap; the current version's tokens get TIS."""
    old, behaviour, mask = ratios([3.0, 3.0, 8.0, 0.5])
    versions = torch.tensor([[4, 5, 4, 4]])  # the policy is at version 5: tokens 0, 2, 3 are stale
    stale_w, _ = behaviour_weights(old, behaviour, versions, 5, mask, "clip", 5.0)
    assert close(stale_w, [[3.0, 1.0, 5.0, 0.5]])
    w, stats = mismatch_weights(old, behaviour, mask, "tis", cap=2.0, stale=versions != 5, stale_weights=stale_w)
    assert close(w, [[3.0, 2.0, 5.0, 0.5]])
    assert stats["mismatch_truncfrac"] == pytest.approx(1 / 4)  # only the current token was truncated


@pytest.mark.parametrize(("correction", "expected"), [("mask", [0.0, 2.0]), ("none", [1.0, 2.0])])
def test_staleness_mask_and_none_still_decide_the_stale_tokens(correction, expected):
    old, behaviour, mask = ratios([3.0, 3.0])
    versions = torch.tensor([[0, 1]])
    stale_w, _ = behaviour_weights(old, behaviour, versions, 1, mask, correction, 5.0)
    w, _ = mismatch_weights(old, behaviour, mask, "tis", cap=2.0, stale=versions != 1, stale_weights=stale_w)
    assert close(w, [expected])


def test_icepop_and_seq_mask_also_reject_stale_tokens_out_of_bounds():
    old, behaviour, mask = ratios([4.0, 1.5], [1.0, 1.0])
    versions = torch.tensor([[0, 1], [0, 0]])
    stale = versions != 1
    stale_w, _ = behaviour_weights(old, behaviour, versions, 1, mask, "clip", 5.0)
    w, _ = mismatch_weights(old, behaviour, mask, "icepop", low=0.5, high=2.0, stale=stale, stale_weights=stale_w)
    assert close(w, [[0.0, 1.5], [1.0, 1.0]])
    w, _ = mismatch_weights(old, behaviour, mask, "seq-mask", stale=stale, stale_weights=stale_w)
    assert close(w, [[0.0, 0.0], [1.0, 1.0]])  # row 0's geometric mean is sqrt(6)


# ------------------------------------------------------------------ through the losses


def seqs_of(mask: torch.Tensor, behaviour: torch.Tensor | None, versions: torch.Tensor | None = None) -> Sequences:
    rows, width = mask.shape
    return Sequences(
        prompt_ids=torch.zeros(rows, 1, dtype=torch.long),
        prompt_mask=torch.ones(rows, 1, dtype=torch.long),
        response_ids=torch.zeros(rows, width, dtype=torch.long),
        response_mask=mask,
        prompt_index=torch.arange(rows),
        texts=("",) * rows,
        logprobs=behaviour,
        versions=versions,
    )


def step_batch(old, behaviour, mask, advantages, versions=None, version=0) -> StepBatch:
    columns = {"responses": seqs_of(mask, behaviour, versions), "old_logprobs": old, "advantages": advantages}
    return StepBatch(columns, policy_version=version)


def random_batch(seed: int, rows: int = 4, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([width, 2, width - 1, 1][:rows])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    old = -torch.rand(rows, width, generator=g) * 2
    logprobs = old + 0.1 * torch.randn(rows, width, generator=g)
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width)
    return old, logprobs, mask, advantages


def algo(**fields) -> AlgoConfig:
    return msgspec.structs.replace(AlgoConfig(kl_coef=0.0), **fields)


def test_tokens_icepop_masks_carry_no_gradient():
    old, logprobs, mask, advantages = random_batch(0)
    behaviour = old.clone()
    behaviour[0, 1] = old[0, 1] + 3.0  # r = e^-3: out of [0.5, 2]
    behaviour[2, 0] = old[2, 0] - 3.0  # r = e^3
    batch = step_batch(old, behaviour, mask, advantages)
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = ppo_loss(lp, batch, algo(mismatch="icepop"))
    loss.backward()
    grad = lp.grad
    assert grad[0, 1] == 0.0 and grad[2, 0] == 0.0
    others = mask.bool().clone()
    others[0, 1] = others[2, 0] = False
    assert bool((grad[others] != 0).all())  # every other valid token still learns
    assert stats["mismatch_maskfrac"] == pytest.approx(2 / int(mask.sum()))


def test_responses_seq_mask_rejects_carry_no_gradient():
    old, logprobs, mask, advantages = random_batch(1)
    behaviour = old.clone()
    behaviour[1] = old[1] - 0.5  # row 1's geometric-mean ratio e^0.5
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = ppo_loss(lp, step_batch(old, behaviour, mask, advantages), algo(mismatch="seq-mask"))
    loss.backward()
    assert bool((lp.grad[1] == 0).all()) and bool((lp.grad[0][mask[0].bool()] != 0).all())
    assert stats["mismatch_seq_maskfrac"] == pytest.approx(1 / 4)


@pytest.mark.parametrize("mode", ["tis", "icepop", "seq-mask", "tis+seq-mask", "icepop+seq-mask"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_an_agreeing_sampler_and_trainer_train_exactly_as_without_correction(mode, agg):
    """Behaviour log-probs equal to the trainer's: every ratio is 1, so the loss and its gradient are
    the same bits as with ``mismatch=none`` and as a batch without the sampler's log-probs."""
    old, logprobs, mask, advantages = random_batch(2)
    results = []
    for behaviour, chosen in ((old.clone(), mode), (old.clone(), "none"), (None, mode)):
        lp = logprobs.clone().requires_grad_(True)
        loss, _ = ppo_loss(lp, step_batch(old, behaviour, mask, advantages), algo(mismatch=chosen, loss_agg=agg))
        loss.backward()
        results.append((loss.detach(), lp.grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])


def test_ppo_applies_the_weights_the_staleness_and_mismatch_corrections_compose():
    """The loss of a batch with stale and current tokens is the uncorrected per-token loss times the
    composed weights: a stale token min(r, is_cap), a current one min(r, mismatch_cap)."""
    old, behaviour, mask = ratios([3.0, 3.0, 0.5])
    versions = torch.tensor([[0, 1, 1]])
    advantages = torch.ones(1, 3)
    logprobs = old.clone()  # policy ratio 1: the per-token loss is -A = -1
    loss, stats = ppo_loss(logprobs, step_batch(old, behaviour, mask, advantages, versions, 1), algo(mismatch="tis"))
    assert float(loss) == pytest.approx(-(3.0 + 2.0 + 0.5) / 3)
    assert stats["offpolicy_frac"] == pytest.approx(1 / 3) and stats["mismatch_truncfrac"] == pytest.approx(1 / 3)


def test_gspo_weighs_each_response_by_its_geometric_mean_ratio():
    # geometric means 4, 1.1 and 0.25; policy ratio 1, advantage 1: each response's loss is -weight
    old, behaviour, mask = ratios([16.0, 1.0], [1.1], [0.25, 0.25])
    batch = step_batch(old, behaviour, mask, torch.ones(3, 2))
    expected = {
        "none": [1.0, 1.0, 1.0],
        "tis": [2.0, 1.1, 0.25],
        "icepop": [0.0, 1.1, 0.0],
        "seq-mask": [0.0, 0.0, 0.0],
        "tis+seq-mask": [0.0, 0.0, 0.0],
    }
    for mode, weights in expected.items():
        loss, stats = gspo_loss(old.clone(), batch, algo(mismatch=mode))
        assert float(loss) == pytest.approx(-sum(weights) / 3), mode
    w, stats = sequence_mismatch_weights(old, behaviour, mask, "seq-mask", seq_low=0.2, seq_high=1.2)
    assert torch.allclose(w, torch.tensor([0.0, 1.0, 1.0])) and stats["mismatch_seq_maskfrac"] == pytest.approx(1 / 3)
    _, stats = gspo_loss(old.clone(), batch, algo(mismatch="tis"))
    assert stats["mismatch_truncfrac"] == pytest.approx(1 / 3) and set(METRICS) <= set(stats)


def test_gspo_with_an_agreeing_sampler_is_unchanged():
    old, logprobs, mask, advantages = random_batch(3)
    plain, _ = gspo_loss(logprobs, step_batch(old, None, mask, advantages), algo())
    for mode in ("tis", "icepop", "seq-mask"):
        corrected, _ = gspo_loss(logprobs, step_batch(old, old.clone(), mask, advantages), algo(mismatch=mode))
        assert torch.equal(corrected, plain), mode


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mismatch_cap", 0.5),
        ("mismatch_cap", float("inf")),
        ("mismatch_low", 0.0),
        ("mismatch_low", 1.0),
        ("mismatch_high", 1.0),
        ("mismatch_high", float("inf")),
        ("mismatch_seq_low", 1.5),
        ("mismatch_seq_high", 0.9),
        ("mismatch_low", float("nan")),
    ],
)
def test_mismatch_bounds_out_of_order_are_refused_naming_the_field(field, value):
    problems = algo_problems(algo(**{field: value}))
    assert [f for f, _ in problems] == [field]
    with pytest.raises(ConfigError, match=f"algo.{field}"):
        api.load("grpo", overrides=[f"algo.{field}={value}"])


def test_an_unknown_mismatch_mode_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="algo.mismatch"):
        api.load("grpo", overrides=["algo.mismatch=tsi"])


def test_a_nodes_own_mismatch_bound_is_checked_naming_the_node():
    with pytest.raises(FlowRLError, match="train_actor.*mismatch_high"):
        api.plan("grpo", overrides=["nodes.train_actor.mismatch_high=0.5"], emit=lambda s: None)


def test_the_default_is_tis_at_a_cap_of_two():
    a = AlgoConfig()
    assert (a.mismatch, a.mismatch_cap, a.mismatch_low, a.mismatch_high) == ("tis", 2.0, 0.5, 2.0)
    assert algo_problems(a) == []


# ------------------------------------------------------------------ a whole run


@pytest.mark.parametrize("mode", ["tis", "icepop+seq-mask"])
@pytest.mark.slow
def test_a_local_run_reports_the_mismatch_metrics_and_masks_nothing(tmp_path, mode):
    """The local engine samples with the trainer's weights in float32: every ratio is ~1, nothing is
    truncated or masked, and each step's metrics.jsonl line says so."""
    overrides = [
        "task=repeat",
        "steps=2",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
        "checkpoint=false",
        "progress=false",
        f"out={tmp_path}",
        f"algo.mismatch={mode}",
    ]
    g, plan = api.plan("grpo", overrides=overrides, emit=lambda s: None)
    result = api.run(g, plan)
    records = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert all(f"train_actor/{k}" in r for k in METRICS), sorted(r)
        assert r["train_actor/mismatch_gap"] < 1e-4
        assert (
            abs(r["train_actor/mismatch_ratio_min"] - 1) < 1e-4 and abs(r["train_actor/mismatch_ratio_max"] - 1) < 1e-4
        )
        assert r["train_actor/mismatch_truncfrac"] == r["train_actor/mismatch_maskfrac"] == 0.0
        assert r["train_actor/mismatch_seq_maskfrac"] == 0.0
