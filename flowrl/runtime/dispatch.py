"""Dispatch and collect by data-parallel rank, defined once and declared on the worker's methods.

Every method a driver calls on a group's ranks (`flowrl.runtime.worker.Worker`) carries a `Dispatch`
mode (`dispatch(...)`, in the spirit of verl's ``@register(dispatch_mode=...)``), which
`flowrl.runtime.groups` reads to send the call and collect its results:

- split ``rows``: the rows of a call (prompts to generate from, sequences to score) are cut into
  contiguous, near-equal shards, one per data shard of the group (`DataRank`: the ranks of one
  shard, e.g. a model's tensor-parallel ranks, take the same rows); the first rank of each shard
  answers, and the answers are concatenated in row order. ``even``: every shard padded to the same
  number of rows (ranks that run collectives in step); else shards without rows are not called.
- split ``all``: every rank receives the whole call (a train step: each rank takes its own share
  of every mini-batch, see `rank_rows`); collected as the first rank's result, the ranks' stats
  averaged, every rank's result, or nothing.

Tasks that run on the controller (rewards, advantages) are not dispatched; a weight sync is a call
of every rank of the trainer's and the generation's groups (``all``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec

from flowrl.contract.data import Sequences, _pad
from flowrl.errors import BackendError

if TYPE_CHECKING:  # torch loads when data moves, not when plugins register (Worker's methods declare modes)
    import torch
    from torch import Tensor


class Dispatch(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How a call reaches a group's ranks (``split``) and how their results come back (``collect``):
    ``first`` (the first rank's), ``mean`` (stats averaged over ranks), ``each`` (every rank's, in rank
    order), ``rows`` (each shard's first rank's, in row order) or ``none``. ``even``: see the module."""

    split: Literal["all", "rows"]
    collect: Literal["first", "mean", "each", "rows", "none"]
    even: bool = False

    def __post_init__(self) -> None:
        if (self.split == "rows") != (self.collect == "rows"):
            raise ValueError(f"dispatch: split {self.split!r} cannot collect {self.collect!r}.")
        if self.even and self.split != "rows":
            raise ValueError("dispatch: only split 'rows' pads shards evenly.")


#: every rank the same call, the first rank's result (all ranks hold the same answer)
ALL_FIRST = Dispatch(split="all", collect="first")
#: every rank the same call, their stats averaged
ALL_MEAN = Dispatch(split="all", collect="mean")
#: every rank the same call, every rank's result
ALL_EACH = Dispatch(split="all", collect="each")
#: every rank the same call, nothing returned
ALL_NONE = Dispatch(split="all", collect="none")
#: the rows cut by data shard, padded so every rank takes the same steps
ROWS_EVEN = Dispatch(split="rows", collect="rows", even=True)
#: the rows cut by data shard, only the shards with rows called
ROWS = Dispatch(split="rows", collect="rows")

F = TypeVar("F", bound=Callable[..., Any])


def dispatch(mode: Dispatch) -> Callable[[F], F]:
    """Declare how a worker method is dispatched to a group's ranks and collected (read by `mode_of`)."""

    def declare(method: F) -> F:
        method.__flowrl_dispatch__ = mode  # type: ignore[attr-defined]
        return method

    return declare


def mode_of(owner: type, method: str) -> Dispatch:
    """The `Dispatch` declared on ``owner.method``; a method without one is refused by name."""
    mode = getattr(getattr(owner, method, None), "__flowrl_dispatch__", None)
    if not isinstance(mode, Dispatch):
        raise TypeError(f"{owner.__name__}.{method} declares no dispatch mode (@dispatch(...)); groups cannot call it.")
    return mode


def collect(mode: Dispatch, results: Sequence[Any]) -> Any:
    """The results of an ``all`` call collected as ``mode`` says."""
    if mode.collect == "first":
        return results[0]
    if mode.collect == "mean":
        return mean_stats(results)
    if mode.collect == "each":
        return list(results)
    if mode.collect == "none":
        return None
    raise ValueError(f"dispatch: collect {mode.collect!r} is not an 'all' collection.")


def shard_ranks(ranks: Sequence[int], data: Sequence[Any]) -> list[tuple[int, ...]]:
    """A group's ``ranks`` by data shard (``data[i]``: rank ``ranks[i]``'s `DataRank`), shards in index
    order, each shard's ranks in group order (its first rank answers); a shard no rank computes is
    refused (the group could not cover its rows)."""
    count = data[0].count if data else 1
    out: list[list[int]] = [[] for _ in range(count)]
    for rank, d in zip(ranks, data):
        if d.count != count or not 0 <= d.index < count:
            raise BackendError(
                f"rank {rank} of group {list(ranks)} says it computes data shard {d.index} of {d.count}; its first "
                f"rank says of {count}. The engines of one model must agree on how their rows are shared (data_rank)."
            )
        out[d.index].append(rank)
    empty = [i for i, s in enumerate(out) if not s]
    if empty:
        raise BackendError(
            f"no rank of group {list(ranks)} computes data shard(s) {empty} of {count}: those rows would be lost. "
            "The engines' data_rank must give every shard a rank."
        )
    return [tuple(s) for s in out]


def draw_seed(generator: torch.Generator) -> int:
    """A seed drawn from ``generator``: what travels to a rank instead of the generator itself."""
    import torch

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
    seqs: Sequences,
    rows: Tensor,
    world: int,
    micro: int,
    max_tokens: int | None,
    packed: bool = False,
    group: int = 1,
) -> list[list[Tensor]]:
    """Each rank's micro-batches of the mini-batch ``rows`` of ``seqs`` (every rank computes all of them
    alike, from the host's rows): rows of similar length together, at most ``micro`` rows each.

    Without ``max_tokens`` a rank takes its strided share (`rank_rows`). With it (a token budget,
    ``train.max_tokens_per_micro_batch``) the rows are dealt to the ranks longest first, each to the
    rank with the fewest tokens so far (so no rank waits on another), and a micro-batch grows while
    its size stays within the budget: rows x (longest prompt + longest response) padded, or the sum
    of its rows' tokens ``packed`` (one row without padding, `flowrl.backends.local.packing`); a row
    longer than the budget is a micro-batch of its own.

    ``group`` > 1 (a loss over pairs: `grouped_micro_batches`): each ``group`` consecutive rows of
    ``rows`` stay together, in order, in one micro-batch of one rank."""
    import torch

    from flowrl.runtime.batch import by_length

    if group > 1:
        return grouped_micro_batches(seqs, rows, world, micro, max_tokens, packed, group)
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


def grouped_micro_batches(
    seqs: Sequences, rows: Tensor, world: int, micro: int, max_tokens: int | None, packed: bool, group: int
) -> list[list[Tensor]]:
    """`micro_batches` of whole groups: ``rows`` is a run of groups of ``group`` consecutive rows (a
    preference pair: chosen, rejected), each kept whole and in order. The groups are dealt to the ranks
    as `micro_batches` deals rows (strided; under ``max_tokens`` longest first, each to the rank with
    the fewest tokens so far), ordered by their longest response, and cut into micro-batches of at most
    ``micro`` rows (at least one group) whose padded (or ``packed``) tokens stay within ``max_tokens``;
    a group over the budget is a micro-batch of its own."""
    import torch

    if len(rows) % group:
        raise BackendError(f"{len(rows)} rows cannot be taken in groups of {group} (a loss over pairs reads both).")
    units = rows.reshape(-1, group)
    prompts = seqs.prompt_mask[rows].sum(-1).reshape(-1, group)
    responses = seqs.response_lengths[rows].reshape(-1, group)
    # a group's size as a micro-batch counts it: its tokens (packed), or its rows x its widest row
    wide_p, wide_r = prompts.max(-1).values.tolist(), responses.max(-1).values.tolist()
    tokens = (prompts + responses).sum(-1).tolist()
    n = len(units)
    if max_tokens is None:
        shares = [list(range(r, n, world)) for r in range(world)]
    else:
        shares = [[] for _ in range(world)]
        load = [0] * world
        for i in sorted(range(n), key=lambda i: (-tokens[i], i)):
            r = min(range(world), key=lambda k: (load[k], k))
            shares[r].append(i)
            load[r] += tokens[i]
    per = max(micro // group, 1)  # groups per micro-batch
    out = []
    for share in shares:
        parts: list[list[int]] = []
        p = r = used = 0
        for i in sorted(share, key=lambda i: (wide_r[i], wide_p[i], i)):
            np_, nr = max(p, wide_p[i]), max(r, wide_r[i])
            size = used + tokens[i] if packed else (len(parts[-1]) + 1 if parts else 1) * group * (np_ + nr)
            if parts and len(parts[-1]) < per and (max_tokens is None or size <= max_tokens):
                parts[-1].append(i)
                p, r, used = np_, nr, used + tokens[i]
            else:
                parts.append([i])
                p, r, used = wide_p[i], wide_r[i], tokens[i]
        out.append([units[torch.tensor(part, dtype=torch.long)].reshape(-1) for part in parts])
    return out


def group_order(n_rows: int, group: int, chunks: int, generator: torch.Generator) -> list[Tensor]:
    """An epoch's rows in a seeded random order, cut into ``chunks`` mini-batches: whole groups of
    ``group`` consecutive rows (each kept in order) when ``group`` > 1; one row each otherwise (the
    same order as ``torch.randperm(n_rows)``)."""
    import torch

    if group <= 1:
        return list(torch.randperm(n_rows, generator=generator).chunk(chunks))
    if n_rows % group:
        raise BackendError(f"{n_rows} rows cannot be cut into groups of {group} (a loss over pairs reads both).")
    order = torch.randperm(n_rows // group, generator=generator)
    return [(part[:, None] * group + torch.arange(group)).flatten() for part in order.chunk(chunks)]


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
    import torch

    parts = [p for p in parts]
    if parts[0].dim() >= 2:
        width = max(p.shape[1] for p in parts)
        parts = [_pad(p, width, fill) for p in parts]
    return torch.cat(parts, 0)


def concat_parts(values: Sequence[Any]) -> Any:
    """Parts of one per-row value (streamed parts, dynamic-sampling rounds) as one, by rows in
    order: Sequences re-padded, tensors and lists concatenated; another value is the last part's."""
    from torch import Tensor

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
