"""Columnar data that flows along graph edges.

A batch is a ``dict[key, value]``. Sequence-level values have one row per sampled response
(B rows): tensors with B as their first dimension, lists of length B, or `Sequences`.
Micro-batching slices all of them with the same row index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sequences:
    """Prompt + response token rows: prompts left-padded, responses right-padded."""

    prompt_ids: Tensor  # [B, P] long
    prompt_mask: Tensor  # [B, P] long, 1 for real prompt tokens
    response_ids: Tensor  # [B, R] long
    response_mask: Tensor  # [B, R] float, 1 for generated tokens (EOS included)
    prompt_index: Tensor  # [B] long: which prompt of the step this row answers (the group)
    texts: tuple[str, ...]  # decoded responses (special tokens removed)
    version: int = 0  # weight version of the model that generated them (the oldest, when they span several)
    logprobs: Tensor | None = None  # [B, R] behaviour log-prob of each response token (None: not generated here)
    versions: Tensor | None = None  # [B, R] long: the weight version that sampled each response token
    # [B, R] float: 1 for the tokens the model sampled, 0 for what an environment wrote into the
    # response (multi-turn); None: every response token was sampled
    action_mask: Tensor | None = None

    @property
    def sampled_mask(self) -> Tensor:
        """1 for the response tokens the model sampled: what losses, advantages and KL cover."""
        return self.response_mask if self.action_mask is None else self.action_mask

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[1])

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(-1).long()

    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def to(self, device: torch.device | str) -> Sequences:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Sequences(
            prompt_ids=move(self.prompt_ids),
            prompt_mask=move(self.prompt_mask),
            response_ids=move(self.response_ids),
            response_mask=move(self.response_mask),
            prompt_index=move(self.prompt_index),
            texts=self.texts,
            version=self.version,
            logprobs=move(self.logprobs),
            versions=move(self.versions),
            action_mask=move(self.action_mask),
        )

    def select(self, idx: Tensor | slice) -> Sequences:
        rows = range(len(self))[idx] if isinstance(idx, slice) else idx.tolist()
        return Sequences(
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            response_ids=self.response_ids[idx],
            response_mask=self.response_mask[idx],
            prompt_index=self.prompt_index[idx],
            texts=tuple(self.texts[i] for i in rows),
            version=self.version,
            logprobs=None if self.logprobs is None else self.logprobs[idx],
            versions=None if self.versions is None else self.versions[idx],
            action_mask=None if self.action_mask is None else self.action_mask[idx],
        )


def by_length(seqs: Sequences, rows: Tensor | None = None) -> Tensor:
    """``rows`` (default: all) ordered by response length, so that micro-batches cut from them
    hold responses of similar length and little padding."""
    rows = torch.arange(len(seqs)) if rows is None else rows
    return rows[torch.argsort(seqs.response_lengths[rows], stable=True)]


def trim(batch: dict[str, Any], key: str) -> dict[str, Any]:
    """``batch`` with the padding columns its sequences (``batch[key]``) do not use cut off: left
    prompt padding and right response padding, and the same response columns of every [B, R]
    value aligned with the responses."""
    seqs: Sequences = batch[key]
    width = seqs.response_ids.shape[1]
    keep_r = int(seqs.response_lengths.max()) if len(seqs) else 0
    keep_p = int(seqs.prompt_mask.sum(-1).max()) if len(seqs) else 0
    if keep_r == width and keep_p == seqs.prompt_len:
        return batch
    cut = lambda t: None if t is None else t[:, :keep_r]  # noqa: E731
    out = {}
    for k, v in batch.items():
        if k == key:
            out[k] = Sequences(
                prompt_ids=v.prompt_ids[:, v.prompt_len - keep_p :],
                prompt_mask=v.prompt_mask[:, v.prompt_len - keep_p :],
                response_ids=cut(v.response_ids),
                response_mask=cut(v.response_mask),
                prompt_index=v.prompt_index,
                texts=v.texts,
                version=v.version,
                logprobs=cut(v.logprobs),
                versions=cut(v.versions),
                action_mask=cut(v.action_mask),
            )
        elif isinstance(v, Tensor) and v.dim() >= 2 and v.shape[0] == len(seqs) and v.shape[1] == width:
            out[k] = v[:, :keep_r]
        else:
            out[k] = v
    return out


def padded_rows(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows as `Sequences` holds them: (prompt_ids, prompt_mask) left-padded and
    (response_ids, response_mask) right-padded, each to its longest row."""
    p_width = max((len(p) for p in prompts), default=0)
    r_width = max((len(r) for r in responses), default=0)
    return (
        ragged(prompts, p_width, pad_id, torch.long, left=True),
        ragged([[1] * len(p) for p in prompts], p_width, 0, torch.long, left=True),
        ragged(responses, r_width, pad_id, torch.long),
        ragged([[1.0] * len(r) for r in responses], r_width, 0.0, torch.float32),
    )


def ragged(values: list[list[Any]], width: int, fill: float, dtype: torch.dtype, left: bool = False) -> torch.Tensor:
    """Ragged rows as one [len(values), width] tensor (right-padded, or left-padded), built in one go."""
    n = len(values)
    out = torch.full((n, width), fill, dtype=dtype)
    lengths = torch.tensor([len(v) for v in values], dtype=torch.long)
    total = int(lengths.sum())
    if total:
        rows = torch.repeat_interleave(torch.arange(n), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        cols = torch.arange(total) - torch.repeat_interleave(starts, lengths)
        if left:
            cols = cols + torch.repeat_interleave(width - lengths, lengths)
        out[rows, cols] = torch.tensor([x for v in values for x in v], dtype=dtype)
    return out


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pack_left(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of ``ids`` with their real tokens (``mask`` 1) moved to the right end, in order,
    padding on the left: prompt + partial response become one left-padded prompt."""
    order = torch.argsort(mask.long(), dim=1, stable=True)
    return ids.gather(1, order), mask.long().gather(1, order)


def select_rows(batch: dict[str, Any], idx: Tensor, n_rows: int) -> dict[str, Any]:
    """Slice every sequence-level value of ``batch`` with row index ``idx``; keep the rest."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, Sequences):
            out[key] = value.select(idx)
        elif isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n_rows:
            out[key] = value[idx]
        elif isinstance(value, (list, tuple)) and len(value) == n_rows:
            out[key] = [value[i] for i in idx.tolist()]
        else:
            out[key] = value
    return out


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Tensors and Sequences of a batch on ``device`` (other values unchanged)."""
    return {k: v.to(device) if isinstance(v, (Tensor, Sequences)) else v for k, v in batch.items()}


def sequences_in(batch: dict[str, Any], who: str) -> Sequences:
    """The one Sequences value in ``batch``; ``who`` (e.g. "node 'gae'", "loss 'ppo'") names the reader."""
    found = [v for v in batch.values() if isinstance(v, Sequences)]
    if len(found) != 1:
        from flowrl.errors import GraphError

        raise GraphError(
            f"{who} must read exactly one key holding generated responses (found {len(found)}); add "
            "e.g. 'responses' to its reads."
        )
    return found[0]
