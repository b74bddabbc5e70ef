"""Dispatch and collect by data-parallel rank, defined once (`flowrl.runtime.groups` applies them
by the kind of call):

- ``rows``: the rows of a call (prompts to generate from, sequences to score) are cut into
  contiguous, near-equal shards, one per rank; results are concatenated in rank order.
- ``replicate``: every rank receives the whole call (a train step: each rank takes its own
  share of every mini-batch, see `rank_rows`), and stats are averaged over ranks.
- ``driver``: the task runs on the controller (rewards, advantages).
- ``sync``: a weight sync; every rank of the trainer's and the generation's groups takes part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from flowrl.data import Sequences, _pad
from flowrl.runtime.batch import by_length


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


def replicas(ranks: Sequence[int], tp: int) -> list[tuple[int, ...]]:
    """A generation group's ranks as its replicas: ``tp`` consecutive ranks each."""
    return [tuple(ranks[i : i + tp]) for i in range(0, len(ranks), tp)]


def rank_rows(rows: Tensor, rank: int, world: int) -> Tensor:
    """This rank's share of a mini-batch's row indices (strided, so shares differ by at most one)."""
    return rows[rank::world]


def micro_batches(
    seqs: Sequences, rows: Tensor, world: int, micro: int, max_tokens: int | None, packed: bool = False
) -> list[list[Tensor]]:
    """Each rank's micro-batches of the mini-batch ``rows`` of ``seqs`` (every rank computes all of them
    alike, from the host's rows): rows of similar length together, at most ``micro`` rows each.

    Without ``max_tokens`` a rank takes its strided share (`rank_rows`). With it (a token budget,
    ``train.max_tokens_per_micro_batch``) the rows are dealt to the ranks longest first, each to the
    rank with the fewest tokens so far (so no rank waits on another), and a micro-batch grows while
    its size stays within the budget: rows x (longest prompt + longest response) padded, or the sum
    of its rows' tokens ``packed`` (one row without padding, `flowrl.backends.local.packing`); a row
    longer than the budget is a micro-batch of its own."""
    if max_tokens is None:
        return [list(by_length(seqs, rank_rows(rows, r, world)).split(max(micro, 1))) for r in range(world)]
    prompts = seqs.prompt_mask[rows].sum(-1).tolist()
    responses = seqs.response_lengths[rows].tolist()
    order = sorted(range(len(rows)), key=lambda i: (-(prompts[i] + responses[i]), i))
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        shares[r].append(i)
        load[r] += prompts[i] + responses[i]
    out = []
    for share in shares:
        parts: list[list[int]] = []
        wide_p = wide_r = used = 0
        for i in sorted(share, key=lambda i: (responses[i], prompts[i], i)):
            p, r = max(wide_p, prompts[i]), max(wide_r, responses[i])
            size = used + prompts[i] + responses[i] if packed else (len(parts[-1]) + 1 if parts else 1) * (p + r)
            if parts and len(parts[-1]) < micro and size <= max_tokens:
                parts[-1].append(i)
                wide_p, wide_r, used = p, r, used + prompts[i] + responses[i]
            else:
                parts.append([i])
                wide_p, wide_r, used = prompts[i], responses[i], prompts[i] + responses[i]
        out.append([rows[torch.tensor(part, dtype=torch.long)] for part in parts])
    return out


def padding(seqs: Sequences, packed: bool = False) -> tuple[int, int]:
    """(computed, real) tokens of one micro-batch as it is computed: its padding cut
    (`Sequences.trimmed`), or none at all ``packed``."""
    real = int(seqs.prompt_mask.sum()) + int(seqs.response_lengths.sum())
    if packed:
        return real, real
    width = int(seqs.prompt_mask.sum(-1).max()) + int(seqs.response_lengths.max()) if len(seqs) else 0
    return len(seqs) * width, real


def concat_rows(parts: Sequence[Tensor], fill: float = 0.0) -> Tensor:
    """[B_i] or [B_i, R_i] results of the ranks as one [sum B_i, max R_i] tensor (right-padded)."""
    parts = [p for p in parts]
    if parts[0].dim() >= 2:
        width = max(p.shape[1] for p in parts)
        parts = [_pad(p, width, fill) for p in parts]
    return torch.cat(parts, 0)


def concat_parts(values: Sequence[Any]) -> Any:
    """Parts of one per-row value (streamed parts, dynamic-sampling rounds) as one, by rows in
    order: Sequences re-padded, tensors and lists concatenated; another value is the last part's."""
    if isinstance(values[0], Sequences):
        return Sequences.concat(values, 0, [0] * len(values))
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
