"""Padding-free micro-batches (``train.pack``): a micro-batch's rows packed into one row of their real
tokens compute the same log-probs, values, scores and gradients as the padded micro-batch, under
SDPA and eager attention, and a token budget then counts real tokens."""

from __future__ import annotations

import copy
import random

import msgspec
import pytest
import torch

from flowrl import api
from flowrl.algorithms.ops import LOSSES
from flowrl.backends.local.packing import pack
from flowrl.backends.local.parallelize import precision
from flowrl.contract.protocols import TrainStep
from flowrl.plugins.manager import registry
from flowrl.runtime.dispatch import micro_batches, padding
from flowrl.runtime.executor import PlanExecutor
from flowrl.tasks.builtin import Copy

ROWS = 9


@pytest.fixture(scope="module")
def engines():
    overrides = ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=3", "task=copy"]
    g, plan = api.plan("ppo", overrides=overrides, emit=lambda s: None)
    trainers, _ = PlanExecutor(registry()).engines(g, plan)
    return plan, trainers


@pytest.fixture(scope="module")
def seqs(engines):
    """ROWS rows of prompts of different lengths and responses of 1 to the whole budget of tokens."""
    _, trainers = engines
    prompts = Copy().prompts(random.Random(0), ROWS)
    out = trainers["actor"].generate(prompts, n=1, greedy=False, generator=torch.Generator().manual_seed(0)).sequences
    width = out.response_ids.shape[1]
    lengths = torch.tensor([1 + (i * 5) % width for i in range(ROWS)])
    assert len(set(out.prompt_mask.sum(-1).tolist())) > 1  # prompts of several lengths: left padding
    return out.replaced(response_mask=(torch.arange(width)[None, :] < lengths[:, None]).float())


def packed(engine, on: bool = True, attention: str | None = None):
    engine = copy.deepcopy(engine)
    engine.spec = msgspec.structs.replace(engine.spec, pack=on)
    if attention:
        precision.set_attention(engine.module, attention, engine.decl.name)
    return engine


def test_packing_drops_the_padding_and_restarts_positions(seqs):
    p = pack(seqs)
    real = int(seqs.prompt_mask.sum()) + int(seqs.response_lengths.sum())
    assert p.tokens == real and padding(seqs, packed=True) == (real, real)
    computed, _ = padding(seqs)
    assert computed > real  # the padded micro-batch computes padding
    starts = (p.position_ids[0] == 0).nonzero().flatten().tolist()
    assert len(starts) == ROWS and starts[0] == 0
    lengths = (seqs.prompt_mask.sum(-1) + seqs.response_lengths).tolist()
    assert [b - a for a, b in zip(starts, [*starts[1:], p.tokens])] == lengths
    # each response token's predictor is the packed token just before it
    for i in range(ROWS):
        n = int(seqs.response_lengths[i])
        got = p.input_ids[0, p.at[i, :n] + 1]
        assert torch.equal(got, seqs.response_ids[i, :n])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_log_probs_values_and_scores_equal_the_padded_ones(engines, seqs, attention):
    _, trainers = engines
    mask = seqs.response_mask
    for model, outputs in (("actor", ["logprobs"]), ("critic", ["values", "scores"])):
        plain, packd = packed(trainers[model], False, attention), packed(trainers[model], True, attention)
        for output in outputs:
            a, b = plain.forward(seqs, output, 4), packd.forward(seqs, output, 4)
            if a.dim() == 2:
                a, b = a * mask, b * mask
            assert float((a - b).abs().max()) < 1e-5, (model, output, attention)


def test_a_packed_train_step_equals_the_padded_one(engines, seqs):
    plan, trainers = engines
    actor = trainers["actor"]
    g = torch.Generator().manual_seed(1)
    old = actor.forward(seqs, "logprobs", 0)
    batch = {
        "responses": seqs,
        "old_logprobs": old + 0.05 * torch.randn(old.shape, generator=g),
        "advantages": torch.randn(ROWS, 1, generator=g) * seqs.response_mask,
    }
    fn, _ = LOSSES["ppo"]
    grads, stats = [], []
    for on in (False, True):
        engine = packed(actor, on)
        step = TrainStep(
            node="train_actor", sequences_key="responses", output="logprobs", micro_batch=4, epochs=1,
            mini_batches=1, algo=plan.config.algo, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        stats.append(engine.train(fn, batch, step))
        grads.append({n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None})
    scale = max(float(v.abs().max()) for v in grads[0].values())
    assert max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0]) < 1e-5 * scale
    assert stats[0]["pad_frac"] > 0.1 and stats[1]["pad_frac"] == 0.0


def test_a_packed_token_budget_counts_real_tokens(seqs):
    rows = torch.arange(ROWS)
    sizes = (seqs.prompt_mask.sum(-1) + seqs.response_lengths).tolist()
    budget = max(sizes) + 10
    for world in (1, 2):
        shares = micro_batches(seqs, rows, world, 64, budget, packed=True)
        parts = [p for share in shares for p in share]
        assert sorted(i for p in parts for i in p.tolist()) == list(range(ROWS))
        assert all(sum(sizes[i] for i in p.tolist()) <= budget for p in parts)
        padded = micro_batches(seqs, rows, world, 64, budget)
        assert sum(len(s) for s in shares) <= sum(len(s) for s in padded)  # fewer or as many micro-steps
