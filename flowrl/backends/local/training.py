"""The torch engine's train step: PPO-style epochs x mini-batches, each mini-batch one optimizer step
accumulated over micro-batches, with gradient clipping, non-finite steps skipped or refused, and a
micro-batch that runs out of memory computed again as two halves.

On several data ranks every rank takes its share of each mini-batch (`flowrl.runtime.dispatch.micro_batches`),
all ranks take the same number of micro-steps, and the averaged gradients equal the one-process gradient
of the whole mini-batch.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.backends.local.parallelize import offload, tensor
from flowrl.backends.local.threads import _locked
from flowrl.contract.data import Sequences, StepBatch
from flowrl.contract.protocols import LossFn, TrainStep
from flowrl.errors import BackendError
from flowrl.runtime.batch import select_rows, to_device, trim
from flowrl.runtime.dispatch import group_order, padding
from flowrl.runtime.nodes import logprob_gap


class Training:
    """`LocalModel`'s train step (a mixin: the engine holds the module, optimizer and dims it uses)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    dims: Any
    decl: Any
    spec: Any
    device: torch.device
    sharded: bool
    distributed: bool
    host_optimizer: bool
    version: int
    oom_splits: int
    warned_oom: bool
    pipeline: Any  # the model's pipeline stages on this rank (None: none); `Staged` runs them

    @_locked
    def train(self, loss: LossFn, batch: StepBatch, step: TrainStep) -> dict[str, float]:
        """PPO-style epochs x mini-batches; each mini-batch is one optimizer step accumulated over micro-batches."""
        opt = self.spec.optimizer
        if self.optimizer is None or opt is None:
            raise BackendError(f"node '{step.node}' trains model '{self.decl.name}', which is frozen.")
        seqs: Sequences = batch[step.sequences_key]
        n_rows = len(seqs)
        if n_rows == 0:  # a filter kept no row: a step without an update (the version still counts it)
            self.version += 1
            return {}
        micro = step.micro_batch or n_rows
        group = max(step.group, 1)  # a loss over pairs: each pair in one micro-batch, in order
        if n_rows % group:
            raise BackendError(
                f"node '{step.node}': its loss reads rows {group} at a time (a chosen and a rejected response), "
                f"but the batch holds {n_rows} rows; train it on a source node with rows='pairs'."
            )
        stats: dict[str, list[float]] = {}
        if self.pipeline is not None:  # the bubble of this step's schedule steps only (not forward passes')
            self.pipeline.times.reset()
        skipped, splits_before = 0, self.oom_splits  # optimizer steps skipped for a non-finite gradient
        computed = useful = 0  # tokens the micro-batches computed, and how many of them were not padding
        self.module.train()
        if group > 1 and self.pipeline is not None:
            raise BackendError(
                f"node '{step.node}': its loss reads rows in pairs, which model '{self.decl.name}' split into pipeline "
                "stages (pp > 1) cannot keep together; plan it without pipeline stages (pp=1)."
            )
        for _ in range(step.epochs):
            for mb in group_order(n_rows, group, step.mini_batches, step.generator):  # the same on every rank
                # every rank's micro-batches (similar lengths together): all ranks take as many micro-steps
                shares = self._micro_batches(seqs, mb, self.dims.data, micro, group)  # a tp row's ranks: the same rows
                parts, steps = shares[self.dims.data_index], max(len(p) for p in shares)
                if self.pipeline is not None:  # in stages: one schedule step (no split: its ranks run in step)
                    acc = self._accumulate_staged(loss, batch, step, mb, parts, steps)  # type: ignore[attr-defined]
                else:
                    acc = self._accumulate_splitting(loss, batch, step, mb, parts, steps)
                if self.pipeline is not None:  # one norm over every stage's gradients (a tied weight's once)
                    copy = self._sum_tied_grads()  # type: ignore[attr-defined]
                    params = list(self.module.parameters())
                    norm = tensor.clip_grad_norm(params, opt.grad_clip, across=self.pipeline.group, uncounted=copy)
                elif self.dims.tensor > 1:  # DTensor slices over the tp mesh beside FSDP shards and whole tensors
                    norm = tensor.clip_grad_norm(list(self.module.parameters()), opt.grad_clip)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), opt.grad_clip)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                if not math.isfinite(float(norm)):  # the same on every rank: the norm is global
                    if not opt.skip_nonfinite:
                        raise BackendError(
                            f"node '{step.node}': the loss ({acc.loss()}) or its gradient (norm {float(norm)}) is not "
                            f"finite, so model '{self.decl.name}' was not updated. Lower train.lr, check the rewards "
                            "and advantages, or set train.skip_nonfinite=true to skip such steps."
                        )
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                computed, useful = computed + acc.computed, useful + acc.useful
                for k, v in acc.stats.items():
                    stats.setdefault(k, []).extend(v)
                stats.setdefault("grad_norm", []).append(float(norm))
                # the mini-batch's loss (of this rank's rows, on several ranks); a sum's is its whole
                stats.setdefault("loss", []).append(acc.total if step.unit == "sum" else acc.loss())
                self._optimizer_step()
        self.module.eval()
        self.version += 1
        finite = {k: [x for x in v if math.isfinite(x)] for k, v in stats.items()}  # a skipped step's loss is not
        # over the micro-batches: a mean, a maximum's the largest, a minimum's the smallest
        out = {
            k: max(v) if k.endswith("_max") else min(v) if k.endswith("_min") else sum(v) / len(v)
            for k, v in finite.items()
            if v
        }
        if opt.skip_nonfinite:
            out["skipped"] = float(skipped)
        if self.oom_splits > splits_before:  # micro-batches split after running out of memory
            out["oom_splits"] = float(self.oom_splits - splits_before)
        out["pad_frac"] = 1.0 - useful / computed if computed else 0.0  # padding among the tokens computed
        if self.pipeline is not None:  # this rank's share of the step spent waiting on other stages
            out["pp_bubble"] = self.pipeline.times.reset().bubble
        return out

    def _accumulate_splitting(
        self, loss: LossFn, batch: StepBatch, step: TrainStep, mb: Tensor, parts: list[Tensor], steps: int
    ) -> _Accumulated:
        """`_accumulate`; a micro-batch whose backward ran out of memory: the mini-batch again, split."""
        while True:
            try:
                return self._accumulate(loss, batch, step, mb, parts, steps)
            except _SplitAndRestart as again:
                parts[again.index : again.index + 1] = again.halves

    def _optimizer_step(self) -> None:
        """AdamW's step; with ``offload`` on a one-process accelerator, its states come from host memory
        for the step and go back after it (FSDP2 steps on the host shards itself)."""
        assert self.optimizer is not None
        if self.host_optimizer:
            offload.host_step(self.optimizer, self.device)
        else:
            self.optimizer.step()

    def _accumulate(
        self, loss: LossFn, batch: StepBatch, step: TrainStep, mb: Tensor, parts: list[Tensor], steps: int
    ) -> _Accumulated:
        """One mini-batch ``mb``'s gradient, accumulated over this rank's micro-batches ``parts`` (``steps``:
        as many as the rank with the most takes). A micro-batch whose forward runs out of memory is
        split in two where it stands (``parts`` changes); one whose backward does raises
        `_SplitAndRestart` (part of its gradient is already added in)."""
        seqs: Sequences = batch[step.sequences_key]
        whole = share_of(seqs, mb, step.unit)  # seqs live on the host
        self.optimizer.zero_grad(set_to_none=True)
        acc = _Accumulated()
        # FSDP averages gradients over its data-parallel ranks: scale by them so they sum, as one process would
        scale = float(self.dims.data if self.sharded else 1)
        i = 0
        while i < max(steps, len(parts)):  # one rank splits only unsharded: its step count is its own
            if self.sharded:  # accumulate locally; reduce-scatter once, at the last micro-step
                self.module.set_requires_gradient_sync(i == steps - 1)
            idle = mb[: max(step.group, 1)]  # a short rank idles (on a whole pair: a pair loss)
            part, weight_on = (parts[i], 1.0) if i < len(parts) else (idle, 0.0)
            view = to_device(trim(select_rows(batch, part, len(seqs)), step.sequences_key), self.device)
            where = f"node '{step.node}' training model '{self.decl.name}'"
            try:
                out = self._outputs(view[step.sequences_key], step.output)
                gap: dict[str, float] = {}
                if step.own:  # what the step computes itself: its own outputs, detached
                    view = view.with_columns({**view.columns, **{k: out.detach() for k in step.own}})
                    # the forward it replaces reported how far the sampler's log-probs are from these
                    gap = logprob_gap(out.detach().cpu(), view[step.sequences_key].to("cpu"), self.version)
                value, step_stats = loss(out, view, step.algo)
                step_stats = {**step_stats, **gap}
            except RuntimeError as err:
                parts[i : i + 1] = self._split(err, part, where, step.group)
                continue
            # the micro-batch's share of the mini-batch, in what the loss is a mean over: the
            # gradients add up to the whole mini-batch's loss's, for any split
            share = share_of(view[step.sequences_key], None, step.unit) / whole
            try:
                (value * (weight_on * scale * share)).backward()
            except RuntimeError as err:
                halves = self._split(err, part, where, step.group)
                self.optimizer.zero_grad(set_to_none=True)
                raise _SplitAndRestart(i, halves) from None
            if weight_on:
                padded, real = padding(view[step.sequences_key], self.spec.pack)
                acc.computed, acc.useful = acc.computed + padded, acc.useful + real
                acc.total, acc.share = acc.total + value.item() * share, acc.share + share
                for k, v in step_stats.items():
                    acc.stats.setdefault(k, []).append(v)
            i += 1
        return acc

    def _split(self, err: RuntimeError, rows: Tensor, where: str, group: int = 1) -> list[Tensor]:
        """``rows`` as two halves, to compute again, when ``err`` is an allocation that failed (the
        device's memory, or the host's) -- said once per model on stderr, and counted by the caller;
        ``err`` itself otherwise, or where halves cannot help (one row, or one ``group`` of rows a loss
        reads together; a sharded model, whose ranks compute their micro-batches in step)."""
        if not out_of_memory(err):
            raise err
        group = max(group, 1)
        if len(rows) < 2 * group or self.distributed:
            single = "a single row" if group == 1 else f"a single group of {group} rows (its loss reads them together)"
            why = single if len(rows) < 2 * group else "one rank of a sharded model (its ranks compute in step)"
            raise BackendError(
                f"{where}: a micro-batch of {len(rows)} row(s) ran out of memory, and it cannot be split "
                f"further ({why}): {str(err).splitlines()[0]}. Lower train.max_tokens_per_micro_batch or "
                "rollout.max_new_tokens, or give the model more memory."
            ) from None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not self.warned_oom:
            self.warned_oom = True
            print(
                f"flowrl: {where}: a micro-batch of {len(rows)} rows ran out of memory; it is computed again as "
                "two halves (the same result; counted as oom_splits in the node's metrics; said once). "
                "train.max_tokens_per_micro_batch caps micro-batches by tokens.",
                file=sys.stderr,
                flush=True,
            )
        self.oom_splits += 1
        half = (len(rows) // group + 1) // 2 * group
        return [rows[:half], rows[half:]]


class _Accumulated:
    """What one mini-batch's micro-steps on this rank added up: the loss weighed by each micro-batch's
    share (``total``) and the shares, the loss's own stats, and the tokens computed / not padding."""

    def __init__(self) -> None:
        self.total = self.share = 0.0
        self.computed = self.useful = 0
        self.stats: dict[str, list[float]] = {}

    def loss(self) -> float:
        return self.total / (self.share or 1.0)


class _SplitAndRestart(Exception):
    """A micro-batch's backward ran out of memory: take the mini-batch again with it as ``halves``."""

    def __init__(self, index: int, halves: list[Tensor]) -> None:
        super().__init__(index)
        self.index, self.halves = index, halves


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a failed allocation: the GPU's (``torch.OutOfMemoryError``) or the host
    allocator's (``DefaultCPUAllocator: can't allocate memory``, under a memory limit)."""
    text = str(err)
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text


def share_of(seqs: Sequences, rows: Tensor | None, unit: str) -> float:
    """How much of a loss ``rows`` of ``seqs`` (None: all) make, in ``unit`` (flowrl.specs.LOSS_UNITS):
    their sampled tokens (a token mean), their number (a mean over rows), or 1 (a sum); at least 1."""
    if unit == "sum":
        return 1.0
    if unit == "seq-mean":
        return float(len(seqs) if rows is None else len(rows)) or 1.0
    mask = seqs.sampled_mask if rows is None else seqs.sampled_mask[rows]
    return max(float(mask.sum()), 1.0)


def adamw(params: list[nn.Parameter], opt: Any) -> torch.optim.AdamW:
    """AdamW over ``params`` with the spec's settings: torch's fused kernel where the parameters allow it
    (CPU and CUDA, plain or FSDP2-sharded) -- on CPU 6-8x faster than the per-tensor loop torch picks by
    default, the same update within rounding -- else that loop."""
    settings = {"lr": opt.lr, "betas": opt.betas, "weight_decay": opt.weight_decay}
    groups = _by_mesh(params)
    try:
        return torch.optim.AdamW(groups, **settings, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype the fused kernel does not take
        return torch.optim.AdamW(groups, **settings)


def _by_mesh(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """``params`` as optimizer parameter groups of one kind each -- the DTensors of one device mesh
    (tensor-parallel slices, FSDP2 shards), the plain tensors -- which a fused or foreach kernel takes
    at once; a single group (as before) when all are of one kind."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return [{"params": ps} for ps in groups.values()]
