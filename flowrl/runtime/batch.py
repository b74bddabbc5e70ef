"""Columnar data that flows along graph edges.

A batch is a mapping of key to value (a ``dict``, or a train step's `StepBatch`, which these
functions return as a `StepBatch` again). Sequence-level values have one row per sampled response
(B rows): tensors with B as their first dimension, lists of length B, or `Sequences`.
Micro-batching slices all of them with the same row index.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flowrl.contract.data import Sequences, StepBatch, sequences_in  # noqa: F401 (re-exported)
from flowrl.contract.responses import padded_rows, ragged  # noqa: F401 (re-exported: runtime modules use them)


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
    cut = seqs.trimmed()
    if cut is seqs:
        return batch
    keep_r = cut.response_ids.shape[1]
    out = {}
    for k, v in batch.items():
        if k == key:
            out[k] = cut
        elif isinstance(v, Tensor) and v.dim() >= 2 and v.shape[0] == len(seqs) and v.shape[1] == width:
            out[k] = v[:, :keep_r]
        else:
            out[k] = v
    return _like(batch, out)


def _like(batch: Any, out: dict[str, Any]) -> Any:
    """``out`` as the same kind of batch as ``batch`` (a `StepBatch` keeps its step facts)."""
    return batch.with_columns(out) if isinstance(batch, StepBatch) else out


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pack_left(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of ``ids`` with their real tokens (``mask`` 1) moved to the right end, in order,
    padding on the left: prompt + partial response become one left-padded prompt."""
    order = torch.argsort(mask.long(), dim=1, stable=True)
    return ids.gather(1, order), mask.long().gather(1, order)


def select_rows(batch: dict[str, Any], idx: Tensor, n_rows: int) -> dict[str, Any]:
    """Slice every sequence-level value of ``batch`` with row index ``idx`` (row numbers or a bool
    mask); keep the rest."""
    if idx.dtype == torch.bool:
        idx = idx.nonzero().flatten()
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
    return _like(batch, out)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Tensors and Sequences of a batch on ``device`` (other values unchanged)."""
    return _like(batch, {k: v.to(device) if isinstance(v, (Tensor, Sequences)) else v for k, v in batch.items()})


def pad_id(tokenizer: Any) -> int:
    """The token rows from several ranks are padded with (0 when an engine has no tokenizer: masks say what is real)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return 0 if pad is None else int(pad)
