"""Batched sampling with a KV cache, returning per-token log-probs.

The log-prob of each sampled token is taken under ``softmax(logits / temperature)`` before
top-p truncation: the same distribution the training forward computes, so PPO's ratio is 1
at the first step (tests bound the difference).

This only samples (a row leaves the batch at EOS, to save work); where a response ends, whether
it is finished and its text are decided by `flowrl.contract.responses`, as for every engine.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor, nn

from flowrl.backends.local.decode import LeanDecoder
from flowrl.runtime.batch import position_ids


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of tokens whose probability mass reaches ``top_p``."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # mass before this token already enough
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``probs`` [B, V], by inverting each row's cumulative distribution at a
    uniform draw: one random number a row (``torch.multinomial`` draws one per vocabulary entry, a
    tenth of a decode step's time over a 49k vocabulary on a CPU)."""
    cumulative = probs.cumsum(-1)
    if not bool(torch.isfinite(cumulative[:, -1]).all()):  # a NaN or inf anywhere in a row reaches its sum
        raise RuntimeError("sampling: the model's next-token probabilities are not finite (NaN or inf logits)")
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cumulative.dtype)
    tok = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True).squeeze(-1)
    # a draw past the last token with mass (rounding in the sum) takes that token: the first index
    # where the running sum reaches its total (the sum rises there, so that token has mass)
    last = (cumulative < cumulative[:, -1:]).sum(-1)
    return torch.minimum(tok, last)


def _whole(logits: Tensor) -> Tensor:
    """The logits over the whole vocabulary: a tensor-parallel model's (a DTensor sharded over the
    vocabulary) gathered from its tp ranks, which then sample alike (the same draws from the same seed)."""
    full = getattr(logits, "full_tensor", None)
    return full() if full is not None else logits


@functools.cache
def _forward_parameters(cls: type) -> frozenset[str]:
    """The keyword names a model class's ``forward`` takes (read once per class: engines ask per pass)."""
    return frozenset(inspect.signature(cls.forward).parameters)


def last_logits_only(model: nn.Module, keep: int) -> dict[str, int]:
    """``logits_to_keep=keep`` for a model that takes it (transformers' causal LMs): the LM head runs on
    the last ``keep`` positions only -- over a large vocabulary, most of a long prompt's cost."""
    return {"logits_to_keep": keep} if "logits_to_keep" in _forward_parameters(type(model)) else {}


def _cache_names(model: nn.Module) -> tuple[str, str]:
    """(forward kwarg, output field) of the KV cache: ``cache`` in transformers >= 5.2x, else ``past_key_values``."""
    if "cache" in _forward_parameters(type(model)):
        return "cache", "cache"
    return "past_key_values", "past_key_values"


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    ignore_eos: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample up to ``max_new_tokens`` per row.

    Returns (tokens [B,R], logprobs [B,R], mask [B,R]); R <= max_new_tokens (stops when every
    row has emitted EOS). A row's mask covers its tokens up to and including EOS.
    """
    batch = prompt_ids.shape[0]
    kwarg, field = _cache_names(model)
    mask = prompt_mask.long()
    # each distinct prompt is read once (the n samples of a prompt are copies of one row): its KV cache
    # and last logits are then shared by its copies, which sample on independently
    rows, copies = torch.unique(torch.cat([prompt_ids * mask, mask], dim=1), dim=0, return_inverse=True)
    width = prompt_ids.shape[1]
    distinct_mask = rows[:, width:]
    distinct_ids = rows[:, :width].masked_fill(distinct_mask == 0, pad_id)
    out = model(
        input_ids=distinct_ids, attention_mask=distinct_mask, position_ids=position_ids(distinct_mask),
        use_cache=True, **last_logits_only(model, 1),
    )  # fmt: skip
    cache = getattr(out, field)
    logits = _whole(out.logits[:, -1, :])
    cache.batch_select_indices(copies)  # back to the caller's rows, in its order
    logits = logits[copies]
    lean = LeanDecoder.of(model) if max_new_tokens > 1 else None
    if lean is not None:
        layers = cache.layers
        lean.start([layer.keys for layer in layers], [layer.values for layer in layers], mask, max_new_tokens)
    next_pos = mask.sum(-1, keepdim=True)  # position of the first generated token
    device = prompt_ids.device
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    active = torch.arange(batch, device=device)  # the rows still decoding (finished rows leave the batch)
    tokens, logprobs, alive = [], [], []
    for step in range(max_new_tokens):
        scaled = logits.float() / temperature
        logp = torch.log_softmax(scaled, dim=-1)
        if greedy:
            tok = scaled.argmax(-1)
        else:
            tok = draw(torch.softmax(top_p_filter(scaled, top_p), dim=-1), generator)
        lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        full = tok
        if len(active) < batch:  # back to the caller's rows: finished rows get padding
            full = torch.full((batch,), pad_id, dtype=tok.dtype, device=device).index_put_((active,), tok)
            lp = torch.zeros(batch, dtype=logp.dtype, device=device).index_put_((active,), lp)
        tokens.append(full)
        logprobs.append(lp)
        alive.append(~done)
        if not ignore_eos:
            done = done | (full == eos_id)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        keep = (~done[active]).nonzero().flatten()
        if len(keep) < len(active):  # drop finished rows from the batch and the KV cache
            if lean is not None:
                lean.keep(keep)
            else:
                cache.batch_select_indices(keep)
            active, tok, mask, next_pos = active[keep], tok[keep], mask[keep], next_pos[keep]
        if lean is not None:
            logits = _whole(lean.step(tok, (next_pos + step).squeeze(-1)))
            continue
        mask = torch.cat([mask, torch.ones(len(active), 1, dtype=mask.dtype, device=device)], dim=1)
        out = model(
            input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos + step, use_cache=True, **{kwarg: cache}
        )
        cache = getattr(out, field)
        logits = _whole(out.logits[:, -1, :])
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(alive, 1).float()
