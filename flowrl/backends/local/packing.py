"""Padding-free micro-batches (``train.pack``): the rows of a micro-batch as one row of their real
tokens -- each row's prompt (its left padding dropped) then its response (up to its length) --
with position ids that restart at 0 for each row and no attention mask, so that transformers'
masks keep each token's attention within its own row (`masking_utils.find_packed_sequence_indices`:
a block-causal mask for SDPA and eager attention, varlen kernels for flash attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowrl.backends.local.parallelize.tensor import token_logprobs
from flowrl.contract.data import Sequences


@dataclass(frozen=True)
class Packed:
    input_ids: Tensor  # [1, T]: every row's real tokens, one after another
    position_ids: Tensor  # [1, T]: 0 at each row's first token
    at: Tensor  # [B, R] long: the position whose output predicts response token t (for values: the state before it)
    valid: Tensor  # [B, R] bool: t is one of the row's response tokens
    last: Tensor  # [B] long: each row's last token (where a score is read)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack(seqs: Sequences, pad_id: int | None = None) -> Packed:
    """``seqs`` (prompts left-padded, responses right-padded) packed into one row; ``pad_id``: a row's
    score is read at its last token that is not this id (`score_index`: as HF's classifiers pool)."""
    width = seqs.response_ids.shape[1]
    prompts = seqs.prompt_mask.sum(-1).tolist()
    lengths = seqs.response_lengths.tolist()
    ids, positions, at, last = [], [], [], []
    start = 0
    for i, (p, r) in enumerate(zip(prompts, lengths)):
        ids += [seqs.prompt_ids[i, seqs.prompt_len - p :], seqs.response_ids[i, :r]]
        positions.append(torch.arange(p + r))
        first = start + max(p, 1) - 1  # the prompt's last token predicts the first response token
        at.append(first + torch.arange(width).clamp(max=max(r - 1, 0)))
        tail = seqs.response_ids[i, :r] if r else seqs.prompt_ids[i, seqs.prompt_len - p :]
        back = 0  # trailing tokens that are the pad id (an end-of-text token that is also the pad token)
        if pad_id is not None:
            while back < len(tail) - 1 and int(tail[len(tail) - 1 - back]) == pad_id:
                back += 1
        last.append(start + max(p + r, 1) - 1 - back)
        start += p + r
    valid = torch.arange(width)[None, :] < seqs.response_lengths[:, None]
    return Packed(
        input_ids=torch.cat(ids)[None, :],
        position_ids=torch.cat(positions)[None, :],
        at=torch.stack(at) if at else torch.zeros(0, width, dtype=torch.long),
        valid=valid,
        last=torch.tensor(last, dtype=torch.long),
    )


def response_values(outputs: Tensor, packed: Packed) -> Tensor:
    """[B, R]: a packed row's [T] per-position ``outputs`` at each response token's ``at``; 0 past a
    row's response."""
    return outputs[packed.at.to(outputs.device)] * packed.valid.to(outputs.device)


def response_logprobs(logits: Tensor, packed: Packed, response_ids: Tensor, temperature: float) -> Tensor:
    """[B, R] log-probs of the response tokens under ``softmax(logits / temperature)``, from a packed
    row's [T, V] ``logits``, computed at the real response tokens only; 0 past a row's response."""
    valid = packed.valid.to(logits.device)
    rows = logits[packed.at.to(logits.device)[valid]]  # [N, V]: one per real response token
    logp = token_logprobs(rows, response_ids.to(logits.device)[valid], temperature)
    return torch.zeros(valid.shape, dtype=logp.dtype, device=logits.device).index_put((valid,), logp)


def score_index(ids: Tensor, mask: Tensor, pad_id: int | None) -> Tensor:
    """[B] where a scalar-head model reads each row's score: its last real (mask 1) token that is not
    ``pad_id``, as HF's ``...ForSequenceClassification`` pools (its last token that is not the pad
    token: with an end-of-text token that is also the pad token, the token before it); a row of
    nothing else, its last real token."""
    real = mask.bool()
    scored = real & (ids != pad_id) if pad_id is not None else real
    return torch.where(scored.any(-1), _last(scored), _last(real))


def _last(mask: Tensor) -> Tensor:
    positions = torch.arange(mask.shape[1], device=mask.device)
    return (positions * mask.long()).argmax(-1)
