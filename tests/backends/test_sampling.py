"""Sampling in the local engine (flowrl.backends.local.generation): `draw` takes a token by inverse CDF,
one uniform a row, never outside top-p or without probability, matching the distribution; greedy
sampling is argmax decoding and draws no random number."""

from __future__ import annotations

import types

import torch


def test_draw_never_takes_a_token_outside_top_p_or_without_probability():
    from flowrl.backends.local.generation import draw, top_p_filter

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 4096, generator=g) * 3
    logits[:, ::7] = float("-inf")  # tokens of no probability scattered through the vocabulary
    for top_p in (1.0, 0.9, 0.3, 1e-3):
        for temperature in (1.0, 0.3, 2.5):
            probs = torch.softmax(top_p_filter(logits / temperature, top_p), -1)
            for _ in range(20):
                tok = draw(probs, g)
                assert tok.shape == (32,) and tok.dtype == torch.long
                assert bool((probs.gather(1, tok[:, None]) > 0).all()), (top_p, temperature)
            if top_p == 1e-3:  # the nucleus is the top token alone
                assert torch.equal(draw(probs, g), logits.argmax(-1))


def test_draw_matches_the_distribution_and_takes_one_random_number_a_row():
    from flowrl.backends.local.generation import draw

    probs = torch.tensor([0.0, 0.05, 0.0, 0.45, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(3)
    toks = draw(probs.repeat(40_000, 1), g)
    freq = torch.bincount(toks, minlength=7).double() / len(toks)
    assert torch.allclose(freq, probs.double(), atol=0.008)  # > 3 sigma of a 40000-draw frequency
    assert float(freq[[0, 2, 6]].sum()) == 0.0
    # one uniform a row: the generator ends where 5 uniforms leave it, whatever the vocabulary
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    draw(torch.softmax(torch.randn(5, 50_000), -1), a)
    torch.rand((5, 1), generator=b)
    assert torch.equal(a.get_state(), b.get_state())
    # an unnormalised row (a sum off by rounding) is drawn from its own total
    assert int(draw(torch.tensor([[0.0, 2.0, 0.0]]), g)) == 1


def test_greedy_sampling_is_argmax_decoding_and_draws_nothing():
    from flowrl.backends.local.generation import sample

    class Echo(torch.nn.Module):
        """A model whose next-token logits are a fixed function of the last token."""

        def __init__(self) -> None:
            super().__init__()
            self.table = torch.randn(11, 11, generator=torch.Generator().manual_seed(1))

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=True, past_key_values=None):
            cache = past_key_values if past_key_values is not None else _Cache()
            return types.SimpleNamespace(logits=self.table[input_ids], past_key_values=cache)

    model = Echo()
    ids = torch.tensor([[3, 4], [5, 6]])
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    tokens, logprobs, alive = sample(
        model, ids, torch.ones_like(ids), max_new_tokens=5, eos_id=10, pad_id=0, greedy=True, generator=g,
        ignore_eos=True,
    )  # fmt: skip
    assert torch.equal(g.get_state(), state)  # greedy draws no random number
    last = ids[:, -1]
    for step in range(tokens.shape[1]):
        want = model.table[last].argmax(-1)
        assert torch.equal(tokens[:, step], want)
        assert torch.allclose(
            logprobs[:, step], torch.log_softmax(model.table[last], -1).gather(1, want[:, None])[:, 0]
        )
        last = want
    # sampled, at a near-zero temperature, the draw agrees with argmax
    hot, _, _ = sample(
        model, ids, torch.ones_like(ids), max_new_tokens=5, eos_id=10, pad_id=0, temperature=1e-4, generator=g,
        ignore_eos=True,
    )  # fmt: skip
    assert torch.equal(hot, tokens)


class _Cache:
    def batch_select_indices(self, index: torch.Tensor) -> None:
        pass


def test_sampling_draws_from_the_callers_seed_on_every_device():
    """On the CPU the engine draws from the caller's generator itself; on an accelerator from a device
    generator seeded from it (it once drew from one seeded with the model's seed, the same on every
    generation replica, whatever seed a replica was sent)."""
    import pytest

    from flowrl.backends.local.engine import on_device

    host = torch.Generator().manual_seed(5)
    assert on_device(host, torch.device("cpu")) is host
    assert on_device(None, torch.device("cpu")) is None
    if not torch.cuda.is_available():
        pytest.skip("the device branch needs CUDA")
    cuda = torch.device("cuda")

    def draws(seed: int) -> torch.Tensor:
        g = on_device(torch.Generator().manual_seed(seed), cuda)
        return torch.rand(64, generator=g, device=cuda).cpu()

    assert torch.equal(draws(1), draws(1))  # the caller's seed decides the draws
    assert not torch.equal(draws(1), draws(2))  # replicas sent different seeds draw differently
