"""Weight sync strategies: send a model's full state dict from one rank to the others of a
process group, so that the receivers hold tensors bitwise equal to the sender's.

Every function is a collective: the sender (``src``, a global rank) passes its tensors, the
receivers pass tensors of the same names, shapes and dtypes, which are overwritten in place.

- ``full``: one broadcast per tensor.
- ``bucketed``: tensors packed into fixed-size flat buckets (per dtype), one broadcast per
  bucket, pipelined: few large messages instead of many small ones, packing overlapped with
  sending.
- ``sparse``: only the elements that changed since the last sync (compared bit for bit), as
  (index, value) pairs per bucket; the receivers apply them to their copy, which is exact.
  The first sync of a `SparseSync` sends everything, and so does a bucket in which so many
  elements changed that pairs would cost more than the bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_BUCKET_BYTES = 64 * 2**20
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ordered(state: Mapping[str, Tensor]) -> list[tuple[str, Tensor]]:
    return sorted(state.items())


def sync_full(state: Mapping[str, Tensor], src: int, group: Any) -> int:
    """Broadcast every tensor from ``src``; returns the bytes sent."""
    sent = 0
    for _, t in _ordered(state):
        dist.broadcast(t, src=src, group=group)
        sent += t.numel() * t.element_size()
    return sent


def _buckets(state: Mapping[str, Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """Tensors grouped by dtype, then cut into runs of at most ``bucket_bytes`` (a larger tensor is its own)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for _, t in _ordered(state):
        by_dtype.setdefault(t.dtype, []).append(t)
    out: list[list[Tensor]] = []
    for tensors in by_dtype.values():
        run: list[Tensor] = []
        size = 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if run and size + nbytes > bucket_bytes:
                out.append(run)
                run, size = [], 0
            run.append(t)
            size += nbytes
        if run:
            out.append(run)
    return out


class BucketedSync:
    """Bucketed sync with flat buffers kept between syncs and a pipeline: while bucket i travels
    (an async broadcast on gloo's own thread), the sender packs bucket i + 1 and the receivers
    unpack bucket i - 1."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.bucket_bytes = bucket_bytes
        self.flats: list[Tensor] = []

    def __call__(self, state: Mapping[str, Tensor], src: int, group: Any) -> int:
        me = dist.get_rank()
        runs = _buckets(state, self.bucket_bytes)
        shapes = [(sum(t.numel() for t in run), run[0].dtype) for run in runs]
        if [(f.numel(), f.dtype) for f in self.flats] != shapes:
            self.flats = [torch.empty(n, dtype=dtype) for n, dtype in shapes]
        works = []
        for run, flat in zip(runs, self.flats):
            if me == src:
                torch.cat([t.reshape(-1) for t in run], out=flat)
            works.append(dist.broadcast(flat, src=src, group=group, async_op=True))
        sent = 0
        for run, flat, work in zip(runs, self.flats, works):
            work.wait()
            sent += flat.numel() * flat.element_size()
            if me != src:
                _unpack(flat, run)
        return sent


def _unpack(flat: Tensor, run: list[Tensor]) -> None:
    at = 0
    for t in run:
        t.copy_(flat[at : at + t.numel()].view_as(t))
        at += t.numel()


def sync_bucketed(state: Mapping[str, Tensor], src: int, group: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """One bucketed sync with fresh buffers (see `BucketedSync` to keep them); returns bytes sent."""
    return BucketedSync(bucket_bytes)(state, src, group)


class SparseSync:
    """Sparse delta sync: each side keeps the flat buckets of the last sync; only elements whose
    bits changed travel. Exact: the receivers' tensors equal the sender's bit for bit."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.bucket_bytes = bucket_bytes
        self.last: list[Tensor] | None = None
        self.density = 1.0  # fraction of elements sent by the last sync

    def __call__(self, state: Mapping[str, Tensor], src: int, group: Any) -> int:
        me = dist.get_rank()
        runs = _buckets(state, self.bucket_bytes)
        if self.last is None or len(self.last) != len(runs):
            sent = sync_bucketed(state, src, group, self.bucket_bytes)
            self.last = [torch.cat([t.reshape(-1) for t in run]) for run in runs]
            self.density = 1.0
            return sent
        sent, changed_total, total = 0, 0, 0
        for i, run in enumerate(runs):
            old = self.last[i]
            bits = _BITS[old.element_size()]
            count = torch.zeros(1, dtype=torch.int64)
            if me == src:
                new = torch.cat([t.reshape(-1) for t in run])
                index = (new.view(bits) != old.view(bits)).nonzero().flatten()
                count[0] = index.numel()
            dist.broadcast(count, src=src, group=group)
            n = int(count[0])
            sent += 8
            if n * (8 + old.element_size()) >= old.numel() * old.element_size():  # denser than dense: send it all
                if me == src:
                    old.copy_(new)
                dist.broadcast(old, src=src, group=group)
                sent += old.numel() * old.element_size()
            elif n:
                if me == src:
                    values = new[index]
                else:
                    index = torch.empty(n, dtype=torch.int64)
                    values = torch.empty(n, dtype=old.dtype)
                dist.broadcast(index, src=src, group=group)
                dist.broadcast(values, src=src, group=group)
                old[index] = values
                sent += n * (8 + old.element_size())
            changed_total += n
            total += old.numel()
            if me != src:
                _unpack(old, run)
        self.density = changed_total / max(total, 1)
        return sent


def sync_raw(flat: Tensor, src: int, group: Any) -> int:
    """A raw broadcast of one preallocated flat buffer: the yardstick the strategies are measured against."""
    dist.broadcast(flat, src=src, group=group)
    return flat.numel() * flat.element_size()


def state_bytes(state: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
