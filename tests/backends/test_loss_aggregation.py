"""Exact losses under any micro-batching: a loss says what it is a mean over (tokens, rows, or a sum),
and the engine weighs each micro-batch by its share of the mini-batch, so the accumulated gradient
equals the one-micro-batch gradient for any split -- for every built-in loss (ppo under each
``algo.loss_agg``, gspo, sft, value) and for a plugin's sequence-level loss (flowrl-example's
``sequence_pg``), on rows of very different lengths. (Several ranks: tests/ray/test_ray_backend.py.)"""

from __future__ import annotations

import copy
import random

import msgspec
import pytest
import torch

from flowrl import api
from flowrl.algorithms import losses
from flowrl.algorithms.ops import LOSSES, gspo_loss
from flowrl.contract.protocols import TrainStep
from flowrl.plugins.manager import registry
from flowrl.runtime.executor import PlanExecutor
from flowrl.specs import AlgoConfig, loss_unit
from flowrl.tasks.builtin import Copy
from flowrl_example import sequence_pg_loss

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "task=copy", "train.grad_clip=1e9"]
ROWS = 11  # an odd count: micro-batches of 2, 3 and 4 leave a short last one


@pytest.fixture(scope="module")
def engines():
    g, plan = api.plan("ppo", overrides=SMALL, emit=lambda s: None)
    trainers, _ = PlanExecutor(registry()).engines(g, plan)
    return plan, trainers


@pytest.fixture(scope="module")
def batch(engines):
    """ROWS sampled rows whose responses end after 1 to the whole budget of tokens."""
    plan, trainers = engines
    actor = trainers["actor"]
    prompts = Copy().prompts(random.Random(0), ROWS)
    rollout = actor.generate(prompts, n=1, greedy=False, generator=torch.Generator().manual_seed(0))
    seqs = rollout.sequences.replaced(logprobs=rollout.logprobs)  # the sampler's, as a rollout hands them on
    width = seqs.response_ids.shape[1]
    lengths = torch.tensor([1 + (i * 7) % width for i in range(ROWS)])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    seqs = seqs.replaced(response_mask=mask)
    g = torch.Generator().manual_seed(1)
    old = actor.forward(seqs, "logprobs", 0)
    return {
        "responses": seqs,
        "old_logprobs": old + 0.05 * torch.randn(old.shape, generator=g),  # ratios off 1: some clip
        "ref_logprobs": old - 0.1 * torch.rand(old.shape, generator=g),
        "advantages": torch.randn(ROWS, 1, generator=g) * mask,
        "values": torch.randn(ROWS, width, generator=g) * mask,
        "returns": torch.randn(ROWS, width, generator=g) * mask,
    }


def gradient(engine, fn, unit: str, batch: dict, micro: int, algo: AlgoConfig, output: str) -> dict[str, torch.Tensor]:
    """The gradient one mini-batch leaves on ``engine``'s copy (it is kept after the optimizer step)."""
    engine = copy.deepcopy(engine)
    step = TrainStep(
        node="train",
        sequences_key="responses",
        output=output,
        micro_batch=micro,
        epochs=1,
        mini_batches=1,
        algo=algo,
        generator=torch.Generator().manual_seed(0),
        unit=unit,
    )
    engine.train(fn, batch, step)
    return {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}


#: sampler/trainer mismatch masks tight enough that the batch's ratios (its old log-probs are the
#: sampler's plus noise) mask some tokens and some rows: a row's weight must not depend on the split
MISMATCH_MASKS = {
    "mismatch": "icepop+seq-mask",
    "mismatch_low": 0.97,
    "mismatch_high": 1.03,
    "mismatch_seq_low": 0.99,
    "mismatch_seq_high": 1.01,
}
CASES = [
    ("ppo", {"loss_agg": "token-mean"}),
    ("ppo", {"loss_agg": "seq-mean-token-mean"}),
    ("ppo", {"loss_agg": "seq-mean-token-sum-norm", "loss_norm": 24}),
    ("ppo", {"loss_agg": "seq-mean-token-sum-norm", "loss_norm": 24, "kl_coef": 0.5}),
    ("ppo", MISMATCH_MASKS),
    ("gspo", {}),
    ("gspo", MISMATCH_MASKS),
    ("sft", {}),
    ("value", {}),
    ("sequence_pg", {}),
]


@pytest.mark.parametrize(
    ("name", "algo_options"), CASES, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in CASES]
)
def test_every_split_gives_the_one_micro_batch_gradient(engines, batch, name, algo_options):
    plan, trainers = engines
    if name == "sequence_pg":
        fn, aggregate, output = sequence_pg_loss, "seq-mean", "logprobs"
    else:
        fn, meta = LOSSES[name]
        aggregate, output = meta["aggregate"], meta["output"]
    engine = trainers["critic" if output == "values" else "actor"]
    feed = {k: v for k, v in batch.items() if name == "ppo" and algo_options.get("kl_coef") or k != "ref_logprobs"}
    algo = msgspec.structs.replace(plan.config.algo, **algo_options)
    unit = loss_unit(aggregate, algo)
    whole = gradient(engine, fn, unit, feed, ROWS, algo, output)
    scale = max(float(g.abs().max()) for g in whole.values())
    assert scale > 0
    for micro in (1, 2, 3, 4):
        split = gradient(engine, fn, unit, feed, micro, algo, output)
        worst = max(float((split[k] - whole[k]).abs().max()) for k in whole)
        assert worst <= 1e-5 * scale, (name, algo_options, micro, worst, scale)


def test_the_mismatch_cases_mask_some_tokens_and_rows_but_not_all(batch):
    """The mismatch cases above have teeth: their masks leave some tokens and rows out, not all."""
    b = MISMATCH_MASKS
    seqs = batch["responses"]
    args = (batch["old_logprobs"], seqs.logprobs, seqs.response_mask, b["mismatch"])
    bounds = (2.0, b["mismatch_low"], b["mismatch_high"], b["mismatch_seq_low"], b["mismatch_seq_high"])
    _, stats = losses.mismatch_weights(*args, *bounds)
    assert 0 < stats["mismatch_maskfrac"] < 1 and 0 < stats["mismatch_seq_maskfrac"] < 1, stats
    rows, _ = losses.sequence_mismatch_weights(*args, *bounds)
    assert 0 < int((rows == 0).sum()) < ROWS


def test_token_weighting_would_be_wrong_for_a_sequence_level_loss(engines, batch):
    """The property has teeth: weighing gspo's micro-batches by tokens (the old rule) misses its gradient."""
    plan, trainers = engines
    feed = {k: v for k, v in batch.items() if k != "ref_logprobs"}
    algo = plan.config.algo
    whole = gradient(trainers["actor"], gspo_loss, "seq-mean", feed, ROWS, algo, "logprobs")
    wrong = gradient(trainers["actor"], gspo_loss, "token-mean", feed, 3, algo, "logprobs")
    scale = max(float(g.abs().max()) for g in whole.values())
    assert max(float((wrong[k] - whole[k]).abs().max()) for k in whole) > 1e-3 * scale


def test_dr_grpo_aggregation_is_the_mean_over_rows_of_token_sums_over_the_constant():
    loss_tok = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(losses.aggregate(loss_tok, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(losses.aggregate(loss_tok, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(losses.aggregate(loss_tok, mask, "seq-mean-token-sum-norm", 8)) == pytest.approx((6 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError, match="positive norm"):
        losses.aggregate(loss_tok, mask, "seq-mean-token-sum-norm", None)


def test_gspo_clipfrac_counts_only_what_clipping_changed():
    """A batch where no ratio leaves [1 - clip_low, 1 + clip_high] clips nothing; a ratio past 1 + clip_high
    with a negative advantage is not clipped either (the unclipped term is the larger)."""
    from flowrl.contract.data import StepBatch

    seqs_mask = torch.ones(4, 3)
    algo = AlgoConfig(clip_low=0.2, clip_high=0.28)
    old = torch.zeros(4, 3)
    logp = torch.tensor([0.1, -0.1, 0.25, 0.25])[:, None].expand(4, 3)  # ratios 1.105, 0.905, 1.284, 1.284
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 3)
    batch = StepBatch({"responses": _seqs(seqs_mask), "old_logprobs": old, "advantages": adv})
    _, stats = gspo_loss(logp, batch, algo)
    assert stats["clipfrac"] == pytest.approx(0.25)  # only row 2: ratio > 1.28 with a positive advantage


def _seqs(mask):
    from flowrl.contract.data import Sequences

    rows = mask.shape[0]
    return Sequences(
        prompt_ids=torch.zeros(rows, 1, dtype=torch.long),
        prompt_mask=torch.ones(rows, 1, dtype=torch.long),
        response_ids=torch.zeros(rows, mask.shape[1], dtype=torch.long),
        response_mask=mask,
        prompt_index=torch.arange(rows),
        texts=("",) * rows,
    )


def test_a_loss_registered_with_an_unknown_aggregate_is_refused_at_plan_time(tmp_path):
    graph = tmp_path / "g.py"
    graph.write_text(
        "from flowrl import register\n"
        "from flowrl.graph import Graph\n"
        "from flowrl.algorithms.ops import ppo_loss\n"
        "register.loss('odd', needs=('old_logprobs', 'advantages'), aggregate='median')(ppo_loss)\n"
        "def build(cfg):\n"
        "    g = Graph('odd')\n"
        "    g.model('actor', 'actor')\n"
        "    g.generate('rollout', model='actor', reads='prompts', writes='responses old_logprobs', n=2)\n"
        "    g.reward('reward', fn='task', reads='prompts responses', writes='rewards')\n"
        "    g.compute('advantages', fn='grpo', reads='rewards responses', writes='advantages')\n"
        "    g.train('train_actor', model='actor', loss='odd', reads='responses old_logprobs advantages')\n"
        "    return g\n"
    )
    from flowrl.errors import PlanError

    with pytest.raises(PlanError, match=r"loss 'odd' is registered with aggregate='median'; valid: token-mean"):
        api.plan(str(graph), overrides=["steps=1"], emit=lambda s: None)
