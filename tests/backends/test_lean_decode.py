"""The lean decode step (`flowrl.backends.local.decode`) samples what transformers' own forward samples:
greedy tokens equal and log-probs within float32 rounding, for every architecture it takes, with
left-padded prompts and rows leaving the batch at EOS; architectures it does not reproduce decode
through their own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from flowrl.backends.local import generation
from flowrl.backends.local.decode import LeanDecoder

SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=97, max_position_embeddings=128, eos_token_id=5, pad_token_id=0,
)  # fmt: skip

CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "llama-mha-bias": lambda: LlamaConfig(**{**SHAPE, "num_key_value_heads": 4}, attention_bias=True),
    "qwen2": lambda: Qwen2Config(**SHAPE),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=16),
    "mistral-no-window": lambda: MistralConfig(**SHAPE, sliding_window=None),
}


def model_for(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()
    with torch.no_grad():  # sharper logits than a random init's, so greedy choices are far from ties
        model.lm_head.weight.mul_(8.0)
    return model


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 97, (6, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding of different widths
    mask[4, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)


def sample(model, monkeypatch, lean: bool, **kw):
    if not lean:
        monkeypatch.setattr(generation.LeanDecoder, "of", staticmethod(lambda m: None))
    try:
        ids, mask = prompts()
        return generation.sample(model, ids, mask, max_new_tokens=24, eos_id=5, pad_id=0, **kw)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_decoding_matches_the_models_own_forward(name, monkeypatch):
    model = model_for(name)
    assert LeanDecoder.of(model) is not None
    ref_tokens, ref_lp, ref_alive = sample(model, monkeypatch, lean=False, greedy=True)
    tokens, lp, alive = sample(model, monkeypatch, lean=True, greedy=True)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(alive, ref_alive)
    assert torch.allclose(lp, ref_lp, atol=1e-5)


def test_rows_leave_the_batch_at_eos_and_the_rest_decode_on(monkeypatch):
    model = model_for("llama")
    with torch.no_grad():  # make EOS likely so rows finish at different steps
        model.lm_head.weight[5].add_(model.lm_head.weight[6:].mean(0) * 4)
    ref = sample(model, monkeypatch, lean=False, temperature=1.0, generator=torch.Generator().manual_seed(3))
    ours = sample(model, monkeypatch, lean=True, temperature=1.0, generator=torch.Generator().manual_seed(3))
    lengths = ref[2].sum(1)
    assert lengths.min() < lengths.max(), "the batch shrinks: rows end at different steps"
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[2], ref[2])
    assert torch.allclose(ours[1], ref[1], atol=1e-5)


def test_bfloat16_autocast_decodes_close_to_the_models_own_forward(monkeypatch):
    model = model_for("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = sample(model, monkeypatch, lean=False, greedy=True)
        ours = sample(model, monkeypatch, lean=True, greedy=True)
    # bf16 rounding may flip a near-tie; the first tokens are well separated and agree
    assert torch.equal(ours[0][:, :4], ref[0][:, :4])
    assert (ours[0] == ref[0]).float().mean() > 0.9


def test_architectures_it_does_not_reproduce_decode_through_their_own_forward():
    windowed = AutoModelForCausalLM.from_config(MistralConfig(**SHAPE, sliding_window=16))
    assert LeanDecoder.of(windowed) is None
    from transformers import GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert LeanDecoder.of(gpt2) is None
    wrapped = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert LeanDecoder.of(wrapped) is None
    # and sampling with such a model still works, through its forward
    ids = torch.randint(6, 50, (2, 5))
    tokens, _, _ = generation.sample(
        gpt2.eval(), ids, torch.ones_like(ids), max_new_tokens=4, eos_id=5, pad_id=0, greedy=True
    )
    assert tokens.shape == (2, 4)
