"""LoRA (`parallelize.lora`): adapters on the named linear layers, only they train, a model starts as
its base, merged weights compute what the adapted model computes, and tensor-parallel LoRA is refused."""

from __future__ import annotations

import pytest
import torch

from flowrl.backends.local.parallelize import lora
from flowrl.errors import BackendError
from flowrl.specs import LoraConfig

RANK4 = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def _logits(module, ids):
    with torch.no_grad():
        return module(input_ids=ids).logits


def test_only_the_adapters_train_and_the_model_starts_as_its_base(tiny):
    base, adapted = tiny(), tiny()
    lora.add_lora(adapted, RANK4, seed=0, name="actor")
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    ids = torch.arange(3, 11)[None]
    torch.testing.assert_close(_logits(adapted, ids), _logits(base, ids))  # B starts at zero


def test_a_value_models_head_trains_beside_the_adapters(tiny):
    critic = tiny(scalar_head=True)
    lora.add_lora(critic, RANK4, seed=0, name="critic")
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"head.weight", "head.bias"} <= trained


def test_merged_weights_compute_what_the_adapted_model_computes(tiny):
    adapted, plain = tiny(), tiny()
    lora.add_lora(adapted, RANK4, seed=0, name="actor")
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if ".lora_B" in n:
                p.normal_(std=0.1)
    plain.load_state_dict(lora.merge_lora(adapted.state_dict(), RANK4.alpha / RANK4.rank))
    ids = torch.arange(3, 11)[None]
    torch.testing.assert_close(_logits(plain, ids), _logits(adapted, ids), rtol=1e-4, atol=1e-5)
    with lora.adapters_off(adapted):  # switched off: the base
        torch.testing.assert_close(_logits(adapted, ids), _logits(tiny(), ids))


def _trained_adapters(module):
    with torch.no_grad():
        for n, p in module.named_parameters():
            if ".lora_B" in n:
                p.normal_(std=0.1)


def test_a_base_stored_in_bfloat16_computes_the_same_logits_under_autocast_and_merges_to_float32(tiny):
    adapted, stored = tiny(), tiny()
    for m in (adapted, stored):
        lora.add_lora(m, RANK4, seed=0, name="actor")
        _trained_adapters(m)
    lora.store_base(stored, torch.bfloat16)
    assert {p.dtype for n, p in stored.named_parameters() if ".base_layer." in n} == {torch.bfloat16}
    ids = torch.arange(3, 11)[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(_logits(stored, ids), _logits(adapted, ids))
    merged = lora.merge_lora(stored.state_dict(), RANK4.alpha / RANK4.rank)
    assert {v.dtype for v in merged.values()} == {torch.float32}
    key = "model.layers.0.self_attn.q_proj.weight"
    base = adapted.state_dict()["model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not torch.equal(merged[key], base)  # the adapters merged in
    # the float32 base's merge, but for the base's rounding to bfloat16
    torch.testing.assert_close(merged[key], lora.merge_lora(adapted.state_dict(), 2.0)[key], rtol=0, atol=1e-2)


def test_a_merged_copy_shares_the_unadapted_tensors_and_merges_again_only_for_a_new_key(tiny):
    adapted = tiny()
    lora.add_lora(adapted, RANK4, seed=0, name="actor")
    _trained_adapters(adapted)
    merged = lora.MergedCopy(adapted, torch.bfloat16)
    module = merged.refresh(2.0, key=1)
    assert module.model.embed_tokens.weight is adapted.model.embed_tokens.weight
    assert module.lm_head.weight.dtype == torch.bfloat16 and not any(".lora_" in n for n, _ in module.named_modules())
    plain = lora.merge_lora(adapted.state_dict(), 2.0)
    state = module.state_dict()
    assert all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in plain.items())
    with torch.no_grad():
        adapted.model.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(1.0)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(merged.refresh(2.0, key=1).state_dict()[q], state[q])  # the same key: not merged again
    fresh = lora.merge_lora(adapted.state_dict(), 2.0)[q].to(torch.bfloat16)
    assert torch.equal(merged.refresh(2.0, key=2).state_dict()[q], fresh)


def test_a_target_the_model_lacks_is_refused_naming_its_linear_layers(tiny):
    with pytest.raises(BackendError, match=r"model 'actor': train.lora.target_modules names \['qkv'\].*q_proj"):
        lora.add_lora(tiny(), LoraConfig(rank=2, target_modules=("qkv",)), seed=0, name="actor")


def test_lora_on_a_tensor_parallel_model_is_refused_with_how_to_plan_it():
    lora.check_split(RANK4, 1, "actor")
    lora.check_split(None, 2, "actor")
    with pytest.raises(BackendError, match=r"--require actor.tp=1"):
        lora.check_split(RANK4, 2, "actor")
