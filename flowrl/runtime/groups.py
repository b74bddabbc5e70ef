"""Worker groups: a model seen from the driver, behind the engine protocols.

A `TrainingGroup` is a `TrainingEngine` and a `GenerationGroup` a `GenerationEngine`; each
dispatches a call to the ranks of its device group through a `Transport` and collects the
results by data shard, as the worker's method declares (`flowrl.runtime.dispatch`). The local backend's transport
calls one worker in this process; the Ray backend's calls Ray actors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from flowrl.contract.data import Rollout
from flowrl.runtime import dispatch
from flowrl.runtime.worker import Worker

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.contract.data import Sequences
    from flowrl.contract.protocols import Batch, LossFn, TrainStep
    from flowrl.graph.ir import ModelDecl


#: The schedule task a call belongs to (the executor sets it); workers tag their spans with it.
CURRENT_TASK: ContextVar[str] = ContextVar("flowrl_task", default="")


class Transport(Protocol):
    """How the driver reaches the workers."""

    def call(self, ranks: Sequence[int], method: str, args: Sequence[tuple[Any, ...]], tag: str) -> list[Any]:
        """Run ``Worker.method(*args[i])`` on ``ranks[i]`` (all at once); results in the same order."""
        ...

    def spans(self) -> dict[int, list[tuple[str, float, float]]]:
        """Each rank's recorded (tag, start, end) spans since the last call."""
        ...

    def close(self) -> None: ...


class InProcessTransport:
    """One worker (rank 0) in this process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.tag = ""

    def call(self, ranks: Sequence[int], method: str, args: Sequence[tuple[Any, ...]], tag: str) -> list[Any]:
        return [self.worker.call(method, tag, *a) for a in args]

    def spans(self) -> dict[int, list[tuple[str, float, float]]]:
        return {0: self.worker.spans()}

    def close(self) -> None:
        self.worker.close_engines()


class _Dispatcher:
    """A group's ranks and how each call reaches them: the `Dispatch` mode declared on the worker's method
    (`flowrl.runtime.dispatch`), rows cut by the data shards the ranks declare (`Worker.data_rank`, asked
    once, only when the group has several ranks)."""

    side = "train"

    def __init__(self, model: str, ranks: Sequence[int], transport: Transport) -> None:
        self.model, self.ranks, self.transport = model, tuple(ranks), transport
        self._shards: list[tuple[int, ...]] | None = None

    @property
    def shards(self) -> list[tuple[int, ...]]:
        """The group's ranks by data shard (each shard's ranks compute the same rows; its first answers)."""
        if self._shards is None:
            if len(self.ranks) == 1:
                self._shards = [self.ranks]
            else:
                args = [(self.model, self.side)] * len(self.ranks)
                data = self.transport.call(self.ranks, "data_rank", args, CURRENT_TASK.get())
                self._shards = dispatch.shard_ranks(self.ranks, data)
        return self._shards

    def all(self, method: str, *args: Any, tag: str | None = None) -> Any:
        """``method`` on every rank with the same arguments, collected as it declares."""
        mode = dispatch.mode_of(Worker, method)
        assert mode.split == "all", f"Worker.{method} is dispatched by rows"
        call = [(self.model, *args)] * len(self.ranks)
        return dispatch.collect(
            mode, self.transport.call(self.ranks, method, call, CURRENT_TASK.get() if tag is None else tag)
        )

    def rows(self, method: str, n: int, args_of: Any) -> tuple[list[Any], list[slice]]:
        """``method`` with the rows ``[0, n)`` cut into one shard per data shard of the group: shard
        ``i``'s ranks each receive ``args_of(i, rows)`` (``rows``: a slice, or with ``even`` a list of
        row indices padded to the widest shard by repeating its last row); returns the first rank's result
        of each shard called, and the slices they computed."""
        mode = dispatch.mode_of(Worker, method)
        assert mode.split == "rows", f"Worker.{method} is dispatched to all ranks"
        shards = self.shards
        cuts = dispatch.shards(n, len(shards))
        if mode.even:
            width = max(s.stop - s.start for s in cuts)
            used = list(range(len(shards)))
        else:
            used = [i for i, s in enumerate(cuts) if s.stop > s.start] or [0]
        ranks, calls = [], []
        for k, i in enumerate(used):
            rows: Any = cuts[i]
            if mode.even:
                rows = list(range(cuts[i].start, cuts[i].stop)) or [n - 1]
                rows += [rows[-1]] * (width - len(rows))
            ranks += list(shards[i])
            calls += [(self.model, *args_of(k, rows))] * len(shards[i])
        out = self.transport.call(ranks, method, calls, CURRENT_TASK.get())
        firsts, at = [], 0
        for i in used:
            firsts.append(out[at])
            at += len(shards[i])
        return firsts, [cuts[i] for i in used]


class TrainingGroup:
    """A model's training engine on the ranks of its device group: the rows of a call split by the data
    shards its ranks declare (an engine split tensor-parallel says which ranks compute the same rows).
    ``tp``: unused, kept so that callers written before ranks declared their shards keep working."""

    def __init__(
        self,
        decl: ModelDecl,
        ranks: Sequence[int],
        transport: Transport,
        tokenizer: Any,
        hf_config: Any,
        tp: int = 1,
    ) -> None:
        self.decl, self.ranks, self.transport = decl, tuple(ranks), transport
        self.tokenizer, self.hf_config = tokenizer, hf_config
        self.version = 0
        self._to = _Dispatcher(decl.name, ranks, transport)

    def forward(self, seqs: Sequences, output: str, micro_batch: int) -> Tensor:
        """Rows in equal shards, one per data shard (the last real row repeated where a shard is short, so
        that every rank takes the same steps), results concatenated and the padding dropped."""
        n = len(seqs)
        if len(self.ranks) == 1:
            call = [(self.decl.name, seqs, output, micro_batch)]
            return self.transport.call(self.ranks, "forward", call, CURRENT_TASK.get())[0]
        parts, cuts = self._to.rows(
            "forward", n, lambda _, rows: (seqs.select(torch.tensor(rows)), output, micro_batch)
        )
        return dispatch.concat_rows([p[: s.stop - s.start] for p, s in zip(parts, cuts)])

    def train(self, loss: LossFn, batch: Batch, step: TrainStep) -> dict[str, float]:
        stats = self._to.all("train", loss, batch, step)
        self.version += 1
        return stats

    def export_weights(self) -> dict[str, Tensor]:
        return self._to.all("export_weights")

    def import_weights(self, weights: Mapping[str, Tensor]) -> None:
        self._to.all("import_weights", dict(weights))

    def save_state(self, path: Path) -> None:
        self._to.all("save_state", path)

    def load_state(self, path: Path) -> None:
        self.version = self._to.all("load_state", path)

    def save(self, path: Path) -> None:
        self._to.all("save", path)


class _GenerationDispatcher(_Dispatcher):
    side = "generate"


class GenerationGroup:
    """A model's generation replicas on the ranks of its generation group: prompts in shards, one per
    replica (the ranks of a replica split over several, as they declare, take the same call; its first
    rank's result is the replica's). ``tp``: unused, kept for callers written before ranks declared it."""

    def __init__(
        self,
        model: str,
        ranks: Sequence[int],
        transport: Transport,
        pad_id: int,
        resumable: bool = True,
        tp: int = 1,
    ) -> None:
        self.model, self.ranks, self.transport, self.pad_id = model, tuple(ranks), transport, pad_id
        self.version = 0
        self.resumable = resumable
        self._to = _GenerationDispatcher(model, ranks, transport)

    @property
    def replicas(self) -> list[tuple[int, ...]]:
        """The group's ranks by replica."""
        return self._to.shards

    def generate(
        self,
        prompts: Sequence[Any],
        *,
        n: int,
        greedy: bool,
        generator: torch.Generator,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
    ) -> Rollout:
        seed = dispatch.draw_seed(generator)
        extra = (temperature,) if temperature else ()
        parts, cuts = self._to.rows(
            "generate", len(prompts), lambda i, s: (list(prompts[s]), n, greedy, seed + i, max_new_tokens, *extra)
        )
        return Rollout.concat(parts, self.pad_id, [s.start for s in cuts])

    def resume(self, rollout: Rollout, *, generator: torch.Generator, max_new_tokens: int | None = None) -> Rollout:
        seed = dispatch.draw_seed(generator)
        if len(rollout.sequences) == 0:  # no row to continue
            return rollout
        parts, _ = self._to.rows(
            "resume", len(rollout.sequences), lambda i, s: (rollout.select(s), seed + i, max_new_tokens)
        )
        return Rollout.concat(parts, self.pad_id, [0] * len(parts))

    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        self._to.all("load_weights", dict(weights), version, tag="load")
        self.version = version


def publish(trainer: TrainingGroup, generator: GenerationGroup, strategy: str | None, tag: str) -> dict[str, Any]:
    """Make ``trainer``'s weights the ones ``generator`` samples with; the trainer's version is the
    one owner of a model's weight version, and this is the one place the generation side takes it.
    ``strategy`` None: generation samples with the trained weights in place (nothing moves);
    otherwise every rank of both groups moves the weights by the plan's strategy."""
    if strategy is None:
        generator.version = trainer.version
        return {}
    ranks = sorted({*trainer.ranks, *generator.ranks})
    stats = dispatch.collect(
        dispatch.mode_of(Worker, "sync"),
        trainer.transport.call(ranks, "sync", [(trainer.decl.name, strategy, trainer.version)] * len(ranks), tag),
    )
    generator.version = trainer.version
    return {"bytes": max(s["bytes"] for s in stats), "strategy": strategy}
