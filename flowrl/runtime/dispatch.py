"""Dispatch and collect by data-parallel rank, defined once.

Modes (the schedule names one per task):

- ``rows``: the rows of a call (prompts to generate from, sequences to score) are cut into
  contiguous, near-equal shards, one per rank; results are concatenated in rank order.
- ``replicate``: every rank receives the whole call (a train step: each rank takes its own
  share of every mini-batch, see `rank_rows`), and stats are averaged over ranks.
- ``driver``: the task runs on the controller (rewards, advantages).
- ``sync``: a weight sync; every rank of the trainer's and the generation's groups takes part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from flowrl.runtime.batch import Sequences

Dispatch = Literal["rows", "replicate", "driver", "sync"]


def draw_seed(generator: torch.Generator) -> int:
    """A seed drawn from ``generator``: what travels to a rank instead of the generator itself."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def shards(n: int, parts: int) -> list[slice]:
    """``n`` rows cut into ``parts`` contiguous slices whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    out, at = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        out.append(slice(at, at + size))
        at += size
    return out


def rank_rows(rows: Tensor, rank: int, world: int) -> Tensor:
    """This rank's share of a mini-batch's row indices (strided, so shares differ by at most one)."""
    return rows[rank::world]


def lockstep_steps(rows: int, world: int, micro: int) -> int:
    """Micro-steps every rank takes for a mini-batch of ``rows``: the same on all ranks, as
    collectives (FSDP's all-gathers and reduce-scatters) need."""
    per_rank = -(-rows // world)
    return max(1, -(-per_rank // max(micro, 1)))


def _pad_right(t: Tensor, width: int, fill: float) -> Tensor:
    if t.shape[1] == width:
        return t
    out = torch.full((t.shape[0], width, *t.shape[2:]), fill, dtype=t.dtype)
    out[:, : t.shape[1]] = t
    return out


def _pad_left(t: Tensor, width: int, fill: float) -> Tensor:
    if t.shape[1] == width:
        return t
    out = torch.full((t.shape[0], width, *t.shape[2:]), fill, dtype=t.dtype)
    out[:, width - t.shape[1] :] = t
    return out


def concat_rows(parts: Sequence[Tensor], fill: float = 0.0) -> Tensor:
    """[B_i] or [B_i, R_i] results of the ranks as one [sum B_i, max R_i] tensor (right-padded)."""
    parts = [p for p in parts]
    if parts[0].dim() >= 2:
        width = max(p.shape[1] for p in parts)
        parts = [_pad_right(p, width, fill) for p in parts]
    return torch.cat(parts, 0)


def concat_sequences(parts: Sequence[Sequences], pad_id: int, index_offsets: Sequence[int]) -> Sequences:
    """Sequences of the ranks as one: prompts re-padded on the left, responses on the right;
    ``prompt_index`` shifted by each shard's first prompt."""
    p_width = max(s.prompt_ids.shape[1] for s in parts)
    r_width = max(s.response_ids.shape[1] for s in parts)
    return Sequences(
        prompt_ids=torch.cat([_pad_left(s.prompt_ids, p_width, pad_id) for s in parts]),
        prompt_mask=torch.cat([_pad_left(s.prompt_mask, p_width, 0) for s in parts]),
        response_ids=torch.cat([_pad_right(s.response_ids, r_width, pad_id) for s in parts]),
        response_mask=torch.cat([_pad_right(s.response_mask, r_width, 0.0) for s in parts]),
        prompt_index=torch.cat([s.prompt_index + off for s, off in zip(parts, index_offsets)]),
        texts=tuple(t for s in parts for t in s.texts),
        version=min(s.version for s in parts),
        logprobs=_both(parts, "logprobs", r_width, 0.0),
        versions=_both(parts, "versions", r_width, 0),
        action_mask=_both(parts, "action_mask", r_width, 0.0),
    )


def _both(parts: Sequence[Sequences], field: str, width: int, fill: float) -> Tensor | None:
    """A per-token field of every part, right-padded and concatenated (None unless all have it)."""
    values = [getattr(s, field) for s in parts]
    if any(v is None for v in values):
        return None
    return torch.cat([_pad_right(v, width, fill) for v in values])


def concat_parts(values: Sequence[Any]) -> Any:
    """Parts of one per-row value (streamed parts, dynamic-sampling rounds) as one, by rows in
    order: Sequences re-padded, tensors and lists concatenated; another value is the last part's."""
    if isinstance(values[0], Sequences):
        return concat_sequences(values, 0, [0] * len(values))
    if isinstance(values[0], Tensor) and values[0].dim() > 0:
        return concat_rows(values)
    if isinstance(values[0], list):
        return [x for v in values for x in v]
    return values[-1]


def weighted_metrics(runs: Sequence[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """One node's metrics over several parts or rounds of (rows, metrics): numbers averaged
    weighted by rows, anything else the first part's."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(k for _, m in runs for k in m):
        vals = [(m[name], n) for n, m in runs if name in m]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v, _ in vals):
            out[name] = round(sum(v * n for v, n in vals) / max(sum(n for _, n in vals), 1), 6)
        else:
            out[name] = vals[0][0]
    return out


def mean_stats(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Stats of the ranks averaged (keys any rank reported)."""
    keys = dict.fromkeys(k for p in parts for k in p)
    return {k: sum(p[k] for p in parts if k in p) / sum(1 for p in parts if k in p) for k in keys}
