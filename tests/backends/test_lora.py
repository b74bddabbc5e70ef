"""LoRA through peft (train.lora.*): only the adapters train, the base stays as loaded; weight syncs and
HF checkpoints carry the merged weights under the plain model's names; a checkpoint's adapters and
their optimizer state restore exactly."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from flowrl import api
from flowrl.backends.local.models import build_causal_lm, load_tokenizer, model_config
from flowrl.backends.local.parallelize.lora import ADAPTER_FILE
from flowrl.contract.protocols import TrainStep
from flowrl.errors import BackendError
from flowrl.plugins.manager import registry
from flowrl.runtime.executor import PlanExecutor
from flowrl.specs import TinyModelConfig
from flowrl.tasks.builtin import Copy

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "task=copy"]


def engines(*extra: str):
    g, plan = api.plan("grpo", overrides=[*SMALL, *extra], emit=lambda s: None)
    trainers, _ = PlanExecutor(registry()).engines(g, plan)
    return plan, trainers


@pytest.fixture(scope="module")
def lora():
    return engines("train.lora.rank=4", "train.lora.alpha=8")


def _batch(actor):
    r = actor.generate(
        Copy().prompts(random.Random(0), 4), n=2, greedy=False, generator=torch.Generator().manual_seed(0)
    )
    adv = torch.linspace(-1, 1, len(r.sequences))[:, None] * r.sequences.response_mask
    return {"responses": r.sequences, "old_logprobs": r.logprobs, "advantages": adv}


def _train(engine, plan, batch):
    step = TrainStep(
        node="train_actor",
        sequences_key="responses",
        output="logprobs",
        micro_batch=3,
        epochs=1,
        mini_batches=1,
        algo=plan.config.algo,
        generator=torch.Generator().manual_seed(0),
    )
    return engine.train(registry().get("losses", "ppo"), batch, step)


def test_only_the_adapters_train_and_the_merged_weights_sample_what_trains(lora):
    plan, trainers = lora
    actor = copy.deepcopy(trainers["actor"])
    assert plan.models["actor"].lora.rank == 4 and plan.models["ref"].lora is None
    trained = {n for n, p in actor.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for n, p in actor.module.named_parameters() if n in trained
    )
    before = actor.export_weights()
    plain = build_causal_lm(None, actor.hf_config, 0).state_dict()
    assert before.keys() == plain.keys()  # the plain model's names
    assert torch.equal(
        before["model.layers.0.self_attn.q_proj.weight"],
        trainers["ref"].export_weights()["model.layers.0.self_attn.q_proj.weight"],
    )  # B = 0 at first
    base = {n: p.detach().clone() for n, p in actor.module.named_parameters() if n not in trained}
    batch = _batch(actor)
    _train(actor, plan, batch)
    assert all(torch.equal(p, base[n]) for n, p in actor.module.named_parameters() if n in base)  # base untouched
    after = actor.export_weights()
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved > 0  # the adapters moved the merged weights
    # a plain model holding the merged weights computes what the adapted model computes
    twin = engines()[1]["ref"]  # a plain frozen model, as a generation engine holds it
    twin.load_weights(after, 1)
    lp, lp_twin = actor.forward(batch["responses"], "logprobs", 0), twin.forward(batch["responses"], "logprobs", 0)
    assert float((lp - lp_twin).abs().max()) < 1e-5


def test_a_checkpoint_holds_the_adapters_and_a_merged_hf_model_and_restores_exactly(lora, tmp_path):
    plan, trainers = lora
    actor = copy.deepcopy(trainers["actor"])
    _train(actor, plan, _batch(actor))
    actor.save_state(tmp_path / "actor")
    assert (tmp_path / "actor" / ADAPTER_FILE).is_file()
    tok = load_tokenizer(str(tmp_path / "actor"))
    hf = build_causal_lm(str(tmp_path / "actor"), model_config(str(tmp_path / "actor"), TinyModelConfig(), tok), 0)
    merged = actor.export_weights()
    assert all(torch.equal(hf.state_dict()[k], merged[k]) for k in merged)  # a loadable, merged HF model
    fresh = copy.deepcopy(trainers["actor"])
    assert fresh.load_state(tmp_path / "actor") == actor.version
    mine, theirs = dict(actor.module.named_parameters()), dict(fresh.module.named_parameters())
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    a, b = actor.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a)


def test_a_full_checkpoint_is_refused_by_a_lora_model_and_unknown_targets_are_named(lora, tmp_path):
    _, full = engines()
    full["actor"].save_state(tmp_path / "full")
    with pytest.raises(BackendError, match="no readable LoRA adapters"):
        copy.deepcopy(lora[1]["actor"]).load_state(tmp_path / "full")
    with pytest.raises(BackendError, match=r"train.lora.target_modules names \['w_qkv'\]"):
        engines("train.lora.rank=4", "train.lora.target_modules=[w_qkv]")


def test_the_reference_is_the_base_with_the_adapters_off_and_holds_no_second_copy(lora):
    from flowrl.backends.local.engine import LoraBase

    plan, trainers = lora
    actor, ref = trainers["actor"], trainers["ref"]
    assert isinstance(ref, LoraBase) and ref.module is actor.module and ref.lock is actor.lock
    base = ref.export_weights()
    batch = _batch(actor)
    snapshot = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    optimizer = copy.deepcopy(actor.optimizer.state_dict())
    try:
        _train(actor, plan, batch)
        seqs = batch["responses"]
        on, off = actor.forward(seqs, "logprobs", 0), ref.forward(seqs, "logprobs", 0)
        assert float((on - off).abs().max()) > 0  # the trained adapters change the policy, not the reference
        assert all(torch.equal(ref.export_weights()[k], base[k]) for k in base)  # the base did not move
        assert float((actor.forward(seqs, "logprobs", 0) - on).abs().max()) == 0  # adapters back on after the ref
    finally:  # the module fixture's engines go back to how they were
        with torch.no_grad():
            for n, p in actor.module.named_parameters():
                p.copy_(snapshot[n])
        actor.optimizer.load_state_dict(optimizer)


def test_the_plan_prices_the_adapters_and_a_base_held_once():
    def states(*extra: str) -> dict[str, int]:
        _, plan = api.plan("grpo", overrides=[*SMALL, *extra], emit=lambda s: None)
        (estimate,) = plan.memory
        return {k: v for k, v in estimate.breakdown.items() if k.startswith("model ")}

    full, lora = states(), states("train.lora.rank=4")
    assert lora["model actor (weights+grads+optimizer)"] < full["model actor (weights+grads+optimizer)"]
    assert full["model ref (weights)"] > 0 and lora["model ref (the base of actor's LoRA: its weights)"] == 0


# --------------------------------------------------------- computing in bfloat16 (autocast, one process)
@pytest.fixture(scope="module")
def lora_bf16():
    return engines("train.lora.rank=4", "train.lora.alpha=8", "train.dtype=bfloat16")


def _old_path(actor, prompts, greedy: bool, seed: int):
    """What generation sampled before the merged copy: the adapted module itself under autocast."""
    from flowrl.backends.local.generation import sample

    enc = actor.tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)
    with actor._compute():
        tokens, logprobs, alive = sample(
            actor.module, enc["input_ids"], enc["attention_mask"], max_new_tokens=6,
            eos_id=actor.tokenizer.eos_token_id, pad_id=actor.tokenizer.pad_token_id, greedy=greedy,
            ignore_eos=True, generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
    return tokens, logprobs


def _new_path(actor, prompts, greedy: bool, seed: int):
    r = actor.generate(prompts, n=1, greedy=greedy, generator=torch.Generator().manual_seed(seed), max_new_tokens=6)
    width = r.sequences.response_ids.shape[1]
    return r.sequences.response_ids, r.logprobs[:, :width]


def _ignoring_eos(plan, actor):
    import msgspec

    actor.sampling = msgspec.structs.replace(actor.sampling, ignore_eos=True)
    actor.rules = type(actor.rules).of(actor.tokenizer, actor.sampling)
    return actor


def test_a_bfloat16_lora_model_stores_its_frozen_base_in_bfloat16_and_exports_float32(lora_bf16):
    plan, trainers = lora_bf16
    actor = trainers["actor"]
    assert actor.autocast and plan.models["actor"].numerics.dtype == "bfloat16"
    dtypes = {n: p.dtype for n, p in actor.module.named_parameters()}
    assert {d for n, d in dtypes.items() if ".base_layer." in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if ".base_layer." not in n} == {torch.float32}  # adapters, embeddings
    assert {v.dtype for v in actor.export_weights().values()} == {torch.float32}
    assert {v.dtype for v in trainers["ref"].export_weights().values()} == {torch.float32}
    # the logits are those of the float32 base under autocast (which computes it in bfloat16)
    plain = engines("train.lora.rank=4", "train.lora.alpha=8")[1]["actor"]
    seqs = _batch(actor)["responses"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain._forward(seqs, "logprobs").float()
    assert torch.equal(actor.forward(seqs, "logprobs", 0), want)


def test_a_bfloat16_lora_model_samples_from_a_merged_copy_what_the_adapted_module_samples(lora_bf16):
    plan, trainers = lora_bf16
    actor = _ignoring_eos(plan, copy.deepcopy(trainers["actor"]))
    prompts = Copy().prompts(random.Random(1), 4)
    for greedy in (True, False):  # the adapters are zero at first: the merged copy computes the same logits
        tokens, logprobs = _new_path(actor, prompts, greedy, 3)
        old_tokens, old_logprobs = _old_path(actor, prompts, greedy, 3)
        assert torch.equal(tokens, old_tokens) and torch.equal(logprobs, old_logprobs)
    assert actor.merged is not None
    assert {p.dtype for p in actor.merged.module.parameters()} >= {torch.bfloat16}
    shared = {p.data_ptr() for p in actor.module.parameters()}
    assert actor.merged.module.model.embed_tokens.weight.data_ptr() in shared  # not a second copy of it
    assert trainers["ref"].merged is None


def test_after_a_train_step_the_merged_copy_samples_the_new_weights(lora_bf16):
    from flowrl.backends.local.generation import sample

    plan, trainers = lora_bf16
    actor = _ignoring_eos(plan, copy.deepcopy(trainers["actor"]))
    prompts = Copy().prompts(random.Random(1), 4)
    _new_path(actor, prompts, True, 0)  # the merged copy holds the untrained weights
    _train(actor, plan, _batch(actor))
    tokens, logprobs = _new_path(actor, prompts, False, 5)
    # the merge done by hand: a plain model holding the exported weights, its linear layers in bfloat16
    hand = build_causal_lm(None, actor.hf_config, 0)
    hand.load_state_dict(actor.export_weights())
    for m in hand.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight = torch.nn.Parameter(m.weight.detach().to(torch.bfloat16), requires_grad=False)
    enc = actor.tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)
    with actor._compute():
        want, want_lp, _ = sample(
            hand.eval(), enc["input_ids"], enc["attention_mask"], max_new_tokens=6,
            eos_id=actor.tokenizer.eos_token_id, pad_id=actor.tokenizer.pad_token_id,
            ignore_eos=True, generator=torch.Generator().manual_seed(5),
        )  # fmt: skip
    assert torch.equal(tokens, want) and torch.equal(logprobs, want_lp)
    # close to what the adapted module samples (the merged weights' rounding to bfloat16 apart)
    greedy, greedy_lp = _new_path(actor, prompts, True, 0)
    old_tokens, old_lp = _old_path(actor, prompts, True, 0)
    assert torch.equal(greedy, old_tokens) and float((greedy_lp - old_lp).abs().max()) < 0.05


def test_a_bfloat16_lora_checkpoint_is_float32_and_restores_exactly(lora_bf16, tmp_path):
    plan, trainers = lora_bf16
    actor = _ignoring_eos(plan, copy.deepcopy(trainers["actor"]))
    prompts = Copy().prompts(random.Random(1), 4)
    _train(actor, plan, _batch(actor))
    actor.save_state(tmp_path / "actor")
    tok = load_tokenizer(str(tmp_path / "actor"))
    hf = build_causal_lm(str(tmp_path / "actor"), model_config(str(tmp_path / "actor"), TinyModelConfig(), tok), 0)
    merged = actor.export_weights()
    assert all(hf.state_dict()[k].dtype == torch.float32 and torch.equal(hf.state_dict()[k], merged[k]) for k in merged)
    fresh = _ignoring_eos(plan, copy.deepcopy(trainers["actor"]))
    fresh_before = _new_path(fresh, prompts, False, 2)  # its merged copy holds the untrained weights
    assert fresh.load_state(tmp_path / "actor") == actor.version
    mine, theirs = dict(actor.module.named_parameters()), dict(fresh.module.named_parameters())
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    restored = _new_path(fresh, prompts, False, 2)  # merged again from the restored adapters
    assert all(torch.equal(a, b) for a, b in zip(restored, _new_path(actor, prompts, False, 2)))
    assert fresh_before[0].shape == restored[0].shape


def test_a_float32_lora_model_samples_from_its_module_as_before(lora):
    plan, trainers = lora
    actor = _ignoring_eos(plan, copy.deepcopy(trainers["actor"]))
    prompts = Copy().prompts(random.Random(1), 4)
    for greedy in (True, False):
        tokens, logprobs = _new_path(actor, prompts, greedy, 3)
        old_tokens, old_logprobs = _old_path(actor, prompts, greedy, 3)
        assert torch.equal(tokens, old_tokens) and torch.equal(logprobs, old_logprobs)
    assert actor.merged is None and not actor.autocast
    assert {p.dtype for p in actor.module.parameters()} == {torch.float32}
