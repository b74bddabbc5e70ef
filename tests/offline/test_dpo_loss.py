"""The DPO loss against a hand computation on fixed log-probs (beta, label smoothing, robust, ipo),
its pair metrics, and the training engine keeping each pair in one micro-batch."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.algorithms import losses
from flowrl.algorithms.ops import dpo_loss
from flowrl.contract.data import Completion, Prompt
from flowrl.errors import GraphError
from flowrl.runtime.offline import offline_sequences
from flowrl.specs import AlgoConfig
from flowrl.tasks.tokenizer import build_tokenizer


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


# two pairs: policy and reference summed log-probs of chosen and rejected
PI_C, PI_R, REF_C, REF_R = [-3.0, -5.0], [-4.0, -2.0], [-3.5, -4.0], [-3.0, -2.5]


def _margins() -> list[float]:
    return [(pc - rc) - (pr - rr) for pc, pr, rc, rr in zip(PI_C, PI_R, REF_C, REF_R)]  # [1.5, -0.5]


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.0), (0.5, 0.2)])
def test_the_sigmoid_loss_is_the_hand_computed_cdpo_loss(beta, eps):
    t = torch.tensor
    loss, stats = losses.dpo_loss(t(PI_C), t(PI_R), t(REF_C), t(REF_R), beta=beta, label_smoothing=eps)
    want = sum(-(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h) for h in _margins()) / 2
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert stats["reward_chosen"] == pytest.approx(beta * ((-3.0 + 3.5) + (-5.0 + 4.0)) / 2)
    assert stats["reward_rejected"] == pytest.approx(beta * ((-4.0 + 3.0) + (-2.0 + 2.5)) / 2)
    assert stats["margin"] == pytest.approx(beta * sum(_margins()) / 2)
    assert stats["pref_accuracy"] == 0.5  # the first pair's chosen reward is the higher, the second's is not
    assert stats["logp_chosen"] == -4.0 and stats["logp_rejected"] == -3.0


def test_the_robust_and_ipo_losses_are_their_hand_computations():
    t = torch.tensor
    beta, eps = 0.5, 0.2
    robust, _ = losses.dpo_loss(t(PI_C), t(PI_R), t(REF_C), t(REF_R), beta=beta, label_smoothing=eps,
                                loss_type="robust")  # fmt: skip
    want = sum((-(1 - eps) * _logsig(beta * h) + eps * _logsig(-beta * h)) / (1 - 2 * eps) for h in _margins()) / 2
    assert float(robust) == pytest.approx(want, rel=1e-6)
    ipo, _ = losses.dpo_loss(t(PI_C), t(PI_R), t(REF_C), t(REF_R), beta=beta, loss_type="ipo")
    assert float(ipo) == pytest.approx(sum((h - 1 / (2 * beta)) ** 2 for h in _margins()) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        losses.preference_loss(t([0.0]), 0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="unknown preference loss_type 'hinge'"):
        losses.preference_loss(t([0.0]), 0.1, loss_type="hinge")


def _pair_batch():
    pair = (Completion(pieces=("ab",), trained=(True,), eos=True), Completion(pieces=("b",), trained=(True,), eos=True))
    seqs, _ = offline_sequences([Prompt(text="ab>", answer="ab", completions=pair)] * 2, None, build_tokenizer(), 0,
                                rows="pairs")  # fmt: skip
    return seqs


def test_the_dpo_loss_sums_each_responses_trained_token_log_probs():
    seqs = _pair_batch()  # responses "ab<eos>" (3 tokens), "b<eos>" (2 tokens, one pad)
    logprobs = torch.full(seqs.response_ids.shape, -1.0)
    logprobs[:, -1] = torch.where(seqs.response_mask[:, -1] > 0, -1.0, -100.0)  # padding never counts
    ref = torch.full(seqs.response_ids.shape, -2.0)
    loss, stats = dpo_loss(logprobs, {"responses": seqs, "ref_logprobs": ref}, AlgoConfig(), beta=0.5)
    margin = (-3.0 + 6.0) - (-2.0 + 4.0)  # summed over 3 and 2 tokens
    assert float(loss) == pytest.approx(-_logsig(0.5 * margin))
    assert stats["logp_chosen"] == -3.0 and stats["logp_rejected"] == -2.0 and stats["pref_accuracy"] == 1.0


def test_the_dpo_loss_refuses_rows_that_are_not_pairs():
    seqs = _pair_batch()
    lone = seqs.select(torch.tensor([0, 2]))  # two chosen responses: prompt 0 and prompt 1
    with pytest.raises(GraphError, match="loss 'dpo' reads preference pairs"):
        dpo_loss(torch.zeros(lone.response_ids.shape), {"r": lone, "ref_logprobs": torch.zeros(2, 3)}, AlgoConfig())


def test_micro_batches_of_a_pair_loss_keep_each_pair_whole_and_in_order():
    from flowrl.runtime.dispatch import group_order, micro_batches

    seqs, _ = offline_sequences(
        [Prompt(text="ab>", answer="", completions=(
            Completion(pieces=("a" * k,), trained=(True,)), Completion(pieces=("b" * (7 - k),), trained=(True,))))
         for k in range(1, 7)],
        None, build_tokenizer(), 0, rows="pairs",
    )  # fmt: skip
    for chunk in group_order(len(seqs), 2, 2, torch.Generator().manual_seed(0)):
        assert len(chunk) == 6 and all(int(chunk[i]) % 2 == 0 and chunk[i + 1] == chunk[i] + 1 for i in (0, 2, 4))
        for budget in (None, 12):
            for rank in micro_batches(seqs, chunk, 2, 3, budget, group=2):
                for part in rank:
                    rows = part.tolist()
                    assert len(rows) % 2 == 0 and all(rows[i] % 2 == 0 and rows[i + 1] == rows[i] + 1
                                                      for i in range(0, len(rows), 2))  # fmt: skip
    assert torch.equal(torch.cat(group_order(9, 1, 3, torch.Generator().manual_seed(1))),
                       torch.randperm(9, generator=torch.Generator().manual_seed(1)))  # fmt: skip


@pytest.mark.parametrize("option", ["beta=-1", "beta=0", "label_smoothing=0.5", "label_smoothing=-0.1"])
def test_a_dpo_option_out_of_its_range_is_refused_at_plan_time_naming_it(option):
    from flowrl import api
    from flowrl.errors import FlowRLError

    with pytest.raises(FlowRLError) as err:
        api.plan("graphs/dpo.py", overrides=["rollout.prompts_per_step=4", f"nodes.train_actor.{option}"],
                 flags={"steps": 1}, emit=lambda s: None)  # fmt: skip
    assert "node 'train_actor'" in str(err.value) and f"option '{option.split('=')[0]}'" in str(err.value)
