"""The torch engine's passes over pipeline stages (`flowrl.backends.local.parallelize.pipeline`): a train
step's mini-batch and a forward pass run through the stages by the model's schedule, and the weights
and optimizer state of the stages gathered whole (exports, checkpoints) or restored (each rank its own).

A mini-batch: this data rank's micro-batches (`flowrl.runtime.dispatch.micro_batches`, as without
stages; halved where the schedule needs more of them, `split_to`), padded to one row count and one
width (the schedule's static shapes: a padding row repeats a real one and counts nothing), run as one
schedule step; a tied LM head's two copies then have their gradients summed (`Staged._sum_tied_grads`).
The last stage computes the same loss function
on each micro-batch's real rows, weighed by its share of the mini-batch as `Training._accumulate` does,
so the accumulated gradients are the one-process mini-batch gradient; the loss's stats and the tokens
counted reach every rank of the pipeline from the last one. A forward pass: its micro-batches the same
way, forward only; the last stage's outputs are broadcast to the pipeline's ranks (the first rank of a
data shard, which answers, holds the first stage).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flowrl.backends.local.packing import score_index
from flowrl.backends.local.parallelize import pipeline as pp
from flowrl.contract.data import Sequences, StepBatch
from flowrl.contract.protocols import LossFn, TrainStep
from flowrl.errors import BackendError
from flowrl.runtime.batch import pad_id, position_ids, select_rows, to_device, trim
from flowrl.runtime.dispatch import padding


def slots(parts: list[Tensor], n: int, fallback: int) -> tuple[Tensor, Tensor]:
    """``n`` micro-batches of one row count from ``parts`` (row indices; fewer than ``n``: the rest
    empty): ``rows`` [n x width] the row each slot computes, and ``target`` [n x width] the slot's own
    position for a real row, -1 for padding (a repeated row, or ``fallback`` where a micro-batch has
    none)."""
    width = max([len(p) for p in parts] + [1])
    rows: list[int] = []
    target: list[int] = []
    for k in range(n):
        part = parts[k].tolist() if k < len(parts) else []
        fill = part[-1] if part else fallback
        at = len(rows)
        rows += part + [fill] * (width - len(part))
        target += [at + j for j in range(len(part))] + [-1] * (width - len(part))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(target, dtype=torch.long)


def split_to(parts: list[Tensor], n: int) -> list[Tensor]:
    """``parts`` (row indices) cut until there are ``n`` of them where rows allow, the largest halved
    first: a schedule that needs more micro-batches than a call has (1F1B: one per stage) computes
    smaller ones rather than empty ones."""
    parts = list(parts)
    while len(parts) < n and any(len(p) > 1 for p in parts):
        at = max(range(len(parts)), key=lambda i: len(parts[i]))
        half = (len(parts[at]) + 1) // 2
        parts[at : at + 1] = [parts[at][:half], parts[at][half:]]
    return parts


def inputs_of(seqs: Sequences, pad_id: int | None = None) -> dict[str, Tensor]:
    """What every stage receives for rows ``seqs`` (one trimmed width): token ids, attention mask,
    positions, the response tokens (the last stage's log-probs) and where each row's score is read
    (`score_index`: its last token that is not ``pad_id``)."""
    mask = seqs.attention_mask
    ids = seqs.input_ids
    return {
        "ids": ids,
        "attention_mask": mask,
        "position_ids": position_ids(mask),
        "tokens": seqs.response_ids,
        "last": score_index(ids, mask, pad_id).long(),
    }


class Staged:
    """`LocalModel`'s passes when its model is in pipeline stages (a mixin: ``self.pipeline`` is set)."""

    pipeline: pp.Pipeline
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    dims: Any
    decl: Any
    spec: Any
    sampling: Any
    device: torch.device
    sharded: bool
    version: int

    def _pad(self) -> int:
        """The pad id of the rows (a score is read at each row's last token that is not it)."""
        return pad_id(getattr(self, "tokenizer", None))

    def _forward_staged(self, seqs: Sequences, output: str, micro: int) -> Tensor:
        """`LocalModel.forward` over the stages: every rank of the pipeline returns the outputs."""
        import torch.distributed as dist

        if getattr(self, "text_tokenizer", None) is not None:
            raise BackendError(
                f"model '{self.decl.name}' re-tokenises rows of another tokenizer, which pipeline stages do not; "
                "plan it with pp=1."
            )
        parts = self._micro_batches(seqs, torch.arange(len(seqs)), 1, micro)[0]  # type: ignore[attr-defined]
        n = self.pipeline.micro_batches(max(len(parts), 1))
        rows, target = slots(split_to(parts, n), n, 0)
        view = trim({"s": seqs.select(rows)}, "s")["s"].to(self.device)
        width = seqs.response_ids.shape[1]
        result = torch.zeros((len(seqs), width) if output != "scores" else (len(seqs),), dtype=torch.float32)
        with self._compute():  # type: ignore[attr-defined]
            inputs = inputs_of(view, self._pad())
            out = self.pipeline.run(inputs, n, output, view.prompt_len - 1, self.sampling.temperature)
        if out is not None:
            real = target >= 0
            got = out.float().cpu()[real]
            if got.dim() == 2:
                result[rows[real], : got.shape[1]] = got
            else:
                result[rows[real]] = got
        dist.broadcast(result, src=self.pipeline.last_rank(), group=self.pipeline.group)
        return result

    def _accumulate_staged(
        self, loss: LossFn, batch: StepBatch, step: TrainStep, mb: Tensor, parts: list[Tensor], steps: int
    ) -> Any:
        """`Training._accumulate` over the stages: one schedule step of ``steps`` micro-batches (at least;
        the schedule may need more, which are empty); the accumulated loss and stats on every rank."""
        import torch.distributed as dist

        from flowrl.backends.local.training import _Accumulated, share_of
        from flowrl.runtime.nodes import logprob_gap

        assert self.optimizer is not None
        key = step.sequences_key
        seqs: Sequences = batch[key]
        whole = share_of(seqs, mb, step.unit)
        n = self.pipeline.micro_batches(steps)
        rows, target = slots(split_to(parts, n), n, int(mb[0]))
        view = to_device(trim(select_rows(batch, rows, len(seqs)), key), self.device)
        acc = _Accumulated()
        # FSDP averages gradients over its data-parallel ranks: scale by them so they sum, as one process would
        scale = float(self.dims.data if self.sharded else 1)

        def micro_loss(out: Tensor, where: Tensor) -> Tensor:
            real = (where >= 0).nonzero().flatten()
            if not len(real):  # an empty micro-batch: no gradient, but a backward through the stages
                return out.sum() * 0.0
            mine = select_rows(view, where[real].to(view[key].response_ids.device), len(rows))
            out = out[real]
            gap: dict[str, float] = {}
            if step.own:
                mine = mine.with_columns({**mine.columns, **{k: out.detach() for k in step.own}})
                gap = logprob_gap(out.detach().cpu(), mine[key].to("cpu"), self.version)
            value, stats = loss(out, mine, step.algo)
            share = share_of(mine[key], None, step.unit) / whole
            padded, useful = padding(mine[key], False)
            acc.computed, acc.useful = acc.computed + padded, acc.useful + useful
            acc.total, acc.share = acc.total + value.item() * share, acc.share + share
            for k, v in {**stats, **gap}.items():
                acc.stats.setdefault(k, []).append(v)
            return value * (scale * share)

        self.optimizer.zero_grad(set_to_none=True)
        s = view[key]
        with self._compute():  # type: ignore[attr-defined]
            inputs = inputs_of(s, self._pad())
            self.pipeline.run(inputs, n, step.output, s.prompt_len - 1, self.sampling.temperature, micro_loss, target)
        box = [(acc.total, acc.share, acc.computed, acc.useful, acc.stats)]
        dist.broadcast_object_list(box, src=self.pipeline.last_rank(), group=self.pipeline.group)
        acc.total, acc.share, acc.computed, acc.useful, acc.stats = box[0]
        return acc

    def _sum_tied_grads(self) -> tuple[nn.Parameter, ...]:
        """A tied LM head's two copies (`pp.TiedWeight`): each one's gradient becomes their sum, over the
        first and last pipeline ranks (the one-process gradient of the shared weight); returns the
        copy the gradient norm must not count again (the head's, on the last rank), else none."""
        import torch.distributed as dist

        from flowrl.backends.local.parallelize.tensor import local

        tied = self.pipeline.tied
        if tied is None or tied.name is None:
            return ()
        param = dict(self.module.named_parameters())[tied.name]
        if param.grad is None:  # no gradient reached it: zeros, so the sum is the other copy's
            param.grad = torch.zeros_like(param)
        dist.all_reduce(local(param.grad), group=tied.group)
        return (param,) if tied.is_copy else ()

    def _with_tied(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """``weights`` with a tied LM head's copy (`pp.TiedWeight`) taken from the embedding where they
        hold it once (an HF file), as the one-process model reads them."""
        tied = self.pipeline.tied
        if tied is not None and tied.head not in weights and tied.embedding in weights:
            return {**weights, tied.head: weights[tied.embedding]}
        return weights

    def _gather_stages(self, mine: dict[str, Any]) -> dict[str, Any]:
        """The union of every pipeline rank's ``mine`` (a dict keyed by tensor name), on every rank."""
        import torch.distributed as dist

        every: list[Any] = [None] * self.pipeline.pp
        dist.all_gather_object(every, mine, group=self.pipeline.group)
        out: dict[str, Any] = {}
        for part in every:
            out.update(part)
        return out

    def _staged_state(self) -> dict[str, Tensor]:
        """The whole model's state dict on the host: each stage's tensors gathered over its data and
        tensor ranks, then over the pipeline ranks."""
        from flowrl.backends.local.parallelize.tensor import full

        mine = {k: full(v).detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        return self._gather_stages(mine)

    def _staged_optimizer_state(self) -> dict[str, Any]:
        """The whole optimizer state by parameter name (``state``: name -> its tensors, whole;
        ``param_groups``: settings and parameter names), every stage's, as the one-process model names
        it: a tied LM head's copy (`pp.TiedWeight`, whose state equals the embedding's) is left out, the
        shared weight stored once under the embedding's name, so the state loads into any layout."""
        from flowrl.backends.local.parallelize.tensor import full

        assert self.optimizer is not None
        tied = self.pipeline.tied
        copy = tied.head if tied is not None and tied.is_copy else None
        names = {id(p): n for n, p in self.module.named_parameters() if n != copy}
        state = {
            names[id(p)]: {
                k: full(v).detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in s.items()
            }
            for p, s in self.optimizer.state.items()
            if id(p) in names
        }
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [names[id(p)] for p in g["params"] if id(p) in names],
            }
            for g in self.optimizer.param_groups
        ]
        import torch.distributed as dist

        every: list[Any] = [None] * self.pipeline.pp
        dist.all_gather_object(every, (state, groups), group=self.pipeline.group)
        whole_state: dict[str, Any] = {}
        whole_groups: list[Any] = []
        for s, g in every:
            whole_state.update(s)
            whole_groups += g
        return {"state": whole_state, "param_groups": whole_groups}

    def _load_staged_optimizer_state(self, whole: dict[str, Any]) -> None:
        """Take a whole optimizer state by parameter name (`_staged_optimizer_state` of any pipeline split
        of this model, or FSDP2's whole state): each parameter its own state, held as it is held (tp
        slices, FSDP2 shards) -- a tied LM head's copy the embedding's, where the state holds the shared
        weight once; each group's settings from the saved group holding its first parameter."""
        from flowrl.backends.local.parallelize.tensor import distribute_like

        assert self.optimizer is not None
        params = dict(self.module.named_parameters())
        by_name = {n: g for g in whole["param_groups"] for n in g["params"]}
        tied = self.pipeline.tied
        if tied is not None and tied.head not in by_name and tied.embedding in by_name:
            by_name[tied.head] = by_name[tied.embedding]
        for group in self.optimizer.param_groups:
            own = [n for n, p in params.items() if n in by_name and any(p is q for q in group["params"])]
            if own:
                saved = by_name[own[0]]
                group.update({k: v for k, v in saved.items() if k != "params"})
        for name, p in params.items():
            source = name
            if tied is not None and name == tied.head and name not in whole["state"]:
                source = tied.embedding  # stored once, under the embedding's name
            if source not in whole["state"]:
                continue
            self.optimizer.state[p] = {
                k: (distribute_like(v, p) if v.shape == p.shape else v.clone()) if isinstance(v, Tensor) else v
                for k, v in whole["state"][source].items()
            }
