"""The training engine options as a new user meets them: numerics, token-budget
micro-batches, packing, LoRA, loss aggregation, out-of-memory splits and the plan's memory estimate.
Tests marked xfail(strict=True) show a bug; the others pin down behaviour that works."""

from __future__ import annotations

import copy
import random

import msgspec
import pytest
import torch

from flowrl import api
from flowrl.backends.local.factories import training_engine
from flowrl.backends.local.parallelize import precision
from flowrl.backends.local.parallelize import recompute as recomputation
from flowrl.cli import main
from flowrl.contract.protocols import EngineContext, TrainStep
from flowrl.contract.resolved import ModelRun
from flowrl.graph.ir import ModelDecl
from flowrl.plugins.manager import registry
from flowrl.runtime.dispatch import padding
from flowrl.runtime.executor import PlanExecutor
from flowrl.tasks.builtin import Copy

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "task=copy"]


def _engines(*extra: str, graph: str = "grpo"):
    g, plan = api.plan(graph, overrides=[*SMALL, *extra], emit=lambda s: None)
    trainers, _ = PlanExecutor(registry()).engines(g, plan)
    return plan, trainers


def _plan(*extra: str, graph: str = "grpo"):
    return api.plan(graph, overrides=[*SMALL, *extra], emit=lambda s: None)[1]


@pytest.fixture(scope="module")
def lora():
    """A LoRA actor whose reference is its base (kl_coef > 0 keeps the reference in the graph)."""
    return _engines("train.lora.rank=4", "train.lora.alpha=8", "algo.kl_coef=0.1")


@pytest.fixture(scope="module")
def batch(lora):
    """8 rows of prompts of several lengths and responses of several lengths, off-policy old log-probs."""
    plan, trainers = lora
    actor = trainers["actor"]
    r = actor.generate(
        Copy().prompts(random.Random(0), 4), n=2, greedy=False, generator=torch.Generator().manual_seed(0)
    )
    seqs = r.sequences
    width = seqs.response_ids.shape[1]
    lengths = torch.tensor([1 + (i * 3) % width for i in range(len(seqs))])
    seqs = seqs.replaced(response_mask=(torch.arange(width)[None, :] < lengths[:, None]).float())
    old = actor.forward(seqs, "logprobs", 0)
    noise = 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    return {
        "responses": seqs,
        "old_logprobs": old + noise,
        "advantages": torch.linspace(-1, 1, len(seqs))[:, None] * seqs.response_mask,
        "ref_logprobs": trainers["ref"].forward(seqs, "logprobs", 0),
    }


def _step(plan, micro: int = 3) -> TrainStep:
    return TrainStep(
        node="train_actor", sequences_key="responses", output="logprobs", micro_batch=micro, epochs=1,
        mini_batches=1, algo=plan.config.algo, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip


def _train(engine, plan, batch, micro: int = 3, recompute: bool = False, **spec):
    e = copy.deepcopy(engine)
    e.spec = msgspec.structs.replace(e.spec, **spec)
    if recompute:
        precision.set_attention(e.module, "eager", "actor")
        recomputation.apply(e.module, "actor")
    stats = e.train(registry().get("losses", "ppo"), batch, _step(plan, micro))
    return {n: p.grad.clone() for n, p in e.module.named_parameters() if p.grad is not None}, stats


def _gap(a, b) -> float:
    assert set(a) == set(b)
    scale = max(float(v.abs().max()) for v in a.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


# ------------------------------------------------------------------ what works


@pytest.mark.parametrize(
    "options",
    [
        {"recompute": True},
        {"pack": True},
        {"max_tokens_per_micro_batch": 20},
        {"pack": True, "max_tokens_per_micro_batch": 20, "recompute": True},
        {"micro": 1},
    ],
    ids=["recompute", "pack", "budget", "pack+budget+recompute", "micro1"],
)
def test_lora_gradients_do_not_depend_on_how_the_step_is_computed(lora, batch, options):
    plan, trainers = lora
    base, stats = _train(trainers["actor"], plan, batch)
    assert base and all(".lora_" in n for n in base)  # only the adapters got gradients
    got, other = _train(trainers["actor"], plan, batch, **options)
    assert _gap(base, got) < 1e-5
    assert other["loss"] == pytest.approx(stats["loss"], abs=1e-6)


def test_pad_frac_is_the_padding_among_the_tokens_the_budgeted_micro_batches_compute(lora, batch):
    plan, trainers = lora
    actor = copy.deepcopy(trainers["actor"])
    actor.spec = msgspec.structs.replace(actor.spec, max_tokens_per_micro_batch=20)
    seqs = batch["responses"]
    parts = actor._micro_batches(seqs, torch.arange(len(seqs)), 1, 3)[0]
    sizes = [padding(seqs.select(p)) for p in parts]
    assert all(c <= 20 or len(p) == 1 for (c, _), p in zip(sizes, parts))  # each within the budget
    expected = 1 - sum(r for _, r in sizes) / sum(c for c, _ in sizes)
    _, stats = _train(trainers["actor"], plan, batch, max_tokens_per_micro_batch=20)
    assert stats["pad_frac"] == pytest.approx(expected)
    _, packed = _train(trainers["actor"], plan, batch, pack=True)
    assert packed["pad_frac"] == 0.0


def test_the_lora_reference_computes_the_base_packed_or_not(lora, batch):
    plan, trainers = lora
    ref, seqs = trainers["ref"], batch["responses"]
    plain = ref.forward(seqs, "logprobs", 3)
    packed = copy.copy(ref)
    packed.spec = msgspec.structs.replace(ref.spec, pack=True, max_tokens_per_micro_batch=15)
    mask = seqs.response_mask
    assert float(((plain - packed.forward(seqs, "logprobs", 3)) * mask).abs().max()) < 1e-5


@pytest.mark.parametrize(
    "setting, field",
    [
        ("train.max_tokens_per_micro_batch=0", "train.max_tokens_per_micro_batch"),
        ("train.max_tokens_per_micro_batch=-5", "train.max_tokens_per_micro_batch"),
        ("train.attention=flash_attention_2", "train.attention"),
        ("train.dtype=float16", "train.dtype"),
        ("algo.loss_agg=sum", "algo.loss_agg"),
        ("algo.loss_norm=0", "loss_norm"),
        ("train.lora.dropout=1", "train.lora.dropout"),
        ("train.lora.rank=-1", "train.lora.rank"),
    ],
)
def test_bad_engine_options_are_refused_by_the_cli_naming_the_field(setting, field, capsys):
    assert main(["plan", "graphs/grpo.py", "--set", setting]) != 0
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_unknown_lora_targets_are_refused_before_training_naming_the_field(tmp_path, capsys):
    argv = ["run", "graphs/grpo.py", "--steps", "1", "--quiet", "--set", f"out={tmp_path}", *_sets(SMALL)]
    argv += ["--set", "train.lora.rank=4", "--set", "train.lora.target_modules=[bogus]"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "train.lora.target_modules" in err and "bogus" in err and "Traceback" not in err


def _sets(overrides):
    return [x for o in overrides for x in ("--set", o)]


# ------------------------------------------------------------------ bugs


def test_a_token_budget_lowers_the_plans_activation_estimate():
    def peak(plan):
        return sum(v for k, v in plan.memory[0].breakdown.items() if k.startswith("peak: node train_actor"))

    free, budgeted = _plan(), _plan("train.max_tokens_per_micro_batch=8")
    assert peak(free) > 0
    # 8 tokens per micro-batch, of 64 rows of ~ 30 tokens: far less than a micro-batch of many rows
    assert peak(budgeted) <= peak(free) / 4


def test_the_plan_prices_lora_adapters_on_the_lm_head():
    def states(plan):
        return next(v for k, v in plan.memory[0].breakdown.items() if k.startswith("model actor"))

    attention_only = _plan("train.lora.rank=8", "train.lora.target_modules=[q_proj]")
    head_too = _plan("train.lora.rank=8", "train.lora.target_modules=[q_proj,lm_head]")
    assert states(head_too) > states(attention_only)  # the engine trains rank x (hidden + vocab) more


# ------------------------------------------------------------------ out of memory, simulated


OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GiB"


class _BackwardOOM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(OOM)


def test_forward_and_backward_out_of_memory_splits_give_the_unsplit_gradient_and_count(lora, batch, capsys):
    plan, trainers = lora
    base, stats = _train(trainers["actor"], plan, batch, micro=8)
    ppo = registry().get("losses", "ppo")

    def backward_oom(out, view, algo):  # a micro-batch of more than 2 rows runs out of memory in its backward
        value, s = ppo(out, view, algo)
        return (_BackwardOOM.apply(value) if len(view["responses"]) > 2 else value), s

    for kind in ("forward", "backward"):
        e = copy.deepcopy(trainers["actor"])
        if kind == "forward":
            real = e._outputs

            def outputs(seqs, output, real=real):
                if len(seqs) > 2:
                    raise RuntimeError(OOM)
                return real(seqs, output)

            e._outputs = outputs
        loss = backward_oom if kind == "backward" else ppo
        got = e.train(loss, batch, _step(plan, 8))
        grads = {n: p.grad.clone() for n, p in e.module.named_parameters() if p.grad is not None}
        assert _gap(base, grads) < 1e-5, kind
        assert got["loss"] == pytest.approx(stats["loss"], abs=1e-6)
        assert got["oom_splits"] == 3.0, kind  # 8 rows -> 4 + 4 -> 2 + 2 + 2 + 2
        assert got["pad_frac"] <= stats["pad_frac"]  # smaller micro-batches pad no more
    assert "ran out of memory" in capsys.readouterr().err


def test_a_forward_nodes_out_of_memory_split_gives_the_same_log_probs(lora, batch):
    _, trainers = lora
    seqs = batch["responses"]
    for name in ("actor", "ref"):
        e = copy.copy(trainers[name])
        want = e.forward(seqs, "logprobs", 0)
        real, before = e._outputs, e.oom_splits

        def outputs(s, output, real=real):
            if len(s) > 4:
                raise RuntimeError(OOM)
            return real(s, output)

        e._outputs = outputs
        mask = seqs.response_mask  # past a row's response the values are not defined
        assert torch.allclose(e.forward(seqs, "logprobs", 0) * mask, want * mask, atol=1e-6)
        assert e.oom_splits - before == 1, name


# ------------------------------------------------------------------ packing and another tokenizer


def test_a_reward_model_that_retokenises_scores_the_same_with_pack_and_a_token_budget(tmp_path):
    import importlib.util
    from pathlib import Path

    where = Path(__file__).with_name("test_reward_model_folders.py")
    spec_ = importlib.util.spec_from_file_location("_rm_folders", where)
    helpers = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(helpers)
    PROMPTS, TINY, bpe_tokenizer, classifier_folder = (
        helpers.PROMPTS,
        helpers.TINY,
        helpers.bpe_tokenizer,
        helpers.classifier_folder,
    )

    def make(name, role, checkpoint=None, source=None, **options):
        decl = ModelDecl(name=name, role=role, trainable=False, init_from=None if source is None else "actor")
        spec = ModelRun(model=name, checkpoint=None if checkpoint is None else str(checkpoint), tiny=TINY, **options)
        return training_engine(EngineContext(decl=decl, spec=spec, device="cpu", source=source))

    actor = make("actor", "actor")
    seqs = actor.generate(PROMPTS * 3, n=2, greedy=False, generator=torch.Generator().manual_seed(0)).sequences
    path = classifier_folder(tmp_path / "rm", bpe_tokenizer())
    plain = make("rm", "reward", path, source=actor)
    packed = make("rm", "reward", path, source=actor, pack=True, max_tokens_per_micro_batch=12)
    assert packed.text_tokenizer is actor.tokenizer
    want = plain.forward(seqs, "scores", 0)
    assert torch.allclose(packed.forward(seqs, "scores", 0), want, atol=1e-5)
    assert torch.allclose(packed.forward(seqs, "scores", 3), want, atol=1e-5)
