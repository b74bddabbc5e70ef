"""Worker groups: a model seen from the driver, behind the engine protocols.

A `TrainingGroup` is a `TrainingEngine` and a `GenerationGroup` a `GenerationEngine`; each
dispatches a call to the ranks of its device group through a `Transport` and collects the
results by data-parallel rank (see `flowrl.runtime.dispatch`). The local backend's transport
calls one worker in this process; the Ray backend's calls Ray actors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from flowrl.data import Rollout
from flowrl.runtime import dispatch

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.data import Sequences
    from flowrl.graph.ir import ModelDecl
    from flowrl.runtime.protocols import Batch, LossFn, TrainStep


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


class TrainingGroup:
    """A model's training engine on the ranks of its device group: data parallel over rows of ``tp``
    ranks, each row one copy of the model split tensor-parallel (the ranks of a row compute the same rows)."""

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
        self.tp = tp
        self.version = 0

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self.transport.call(self.ranks, method, [(self.decl.name, *args)] * len(self.ranks), CURRENT_TASK.get())

    def forward(self, seqs: Sequences, output: str, micro_batch: int) -> Tensor:
        """Rows in equal shards, one per data-parallel row of ranks (the last real row repeated where a
        shard is short, so that every rank takes the same steps), results concatenated and the padding
        dropped."""
        n, world = len(seqs), len(self.ranks)
        if world == 1:
            return self.transport.call(
                self.ranks, "forward", [(self.decl.name, seqs, output, micro_batch)], CURRENT_TASK.get()
            )[0]
        cuts = dispatch.shards(n, world // self.tp)
        width = max(s.stop - s.start for s in cuts)
        args = []
        for s in cuts:
            rows = list(range(s.start, s.stop)) or [n - 1]
            rows += [rows[-1]] * (width - len(rows))
            args += [(self.decl.name, seqs.select(torch.tensor(rows)), output, micro_batch)] * self.tp
        parts = self.transport.call(self.ranks, "forward", args, CURRENT_TASK.get())[:: self.tp]
        return dispatch.concat_rows([p[: s.stop - s.start] for p, s in zip(parts, cuts)])

    def train(self, loss: LossFn, batch: Batch, step: TrainStep) -> dict[str, float]:
        stats = dispatch.mean_stats(self._all("train", loss, batch, step))
        self.version += 1
        return stats

    def export_weights(self) -> dict[str, Tensor]:
        return self._all("export_weights")[0]

    def import_weights(self, weights: Mapping[str, Tensor]) -> None:
        self._all("import_weights", dict(weights))

    def save_state(self, path: Path) -> None:
        self._all("save_state", path)

    def load_state(self, path: Path) -> None:
        self.version = self._all("load_state", path)[0]

    def save(self, path: Path) -> None:
        self._all("save", path)


class GenerationGroup:
    """A model's generation replicas on the ranks of its generation group: prompts in shards, one per
    replica (``tp`` consecutive ranks, which a replica split tensor-parallel takes the same call on;
    its first rank's result is the replica's)."""

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
        self.tp = tp
        self.replicas = dispatch.replicas(self.ranks, tp)

    def _call(self, method: str, args: list[tuple[Any, ...]], first: Sequence[int]) -> list[Any]:
        """``method`` on every rank of the replicas whose first ranks are ``first`` (each its args)."""
        ranks = [r for f in first for r in next(rep for rep in self.replicas if rep[0] == f)]
        parts = self.transport.call(ranks, method, [a for a in args for _ in range(self.tp)], CURRENT_TASK.get())
        return parts[:: self.tp]

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
        firsts = [rep[0] for rep in self.replicas]
        cuts = dispatch.shards(len(prompts), len(firsts))
        used = [(r, s) for r, s in zip(firsts, cuts) if s.stop > s.start] or [(firsts[0], cuts[0])]
        args = [
            (self.model, list(prompts[s]), n, greedy, seed + i, max_new_tokens, *([temperature] if temperature else []))
            for i, (_, s) in enumerate(used)
        ]
        parts = self._call("generate", args, [r for r, _ in used])
        return Rollout.concat(parts, self.pad_id, [s.start for _, s in used])

    def resume(self, rollout: Rollout, *, generator: torch.Generator, max_new_tokens: int | None = None) -> Rollout:
        seed = dispatch.draw_seed(generator)
        firsts = [rep[0] for rep in self.replicas]
        cuts = dispatch.shards(len(rollout.sequences), len(firsts))
        used = [(r, s) for r, s in zip(firsts, cuts) if s.stop > s.start]
        if not used:  # no row to continue
            return rollout
        args = []
        for i, (_, s) in enumerate(used):
            args.append((self.model, rollout.select(s), seed + i, max_new_tokens))
        parts = self._call("resume", args, [r for r, _ in used])
        return Rollout.concat(parts, self.pad_id, [0] * len(parts))

    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        self.transport.call(
            self.ranks, "load_weights", [(self.model, dict(weights), version)] * len(self.ranks), "load"
        )
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
    stats = trainer.transport.call(ranks, "sync", [(trainer.decl.name, strategy, trainer.version)] * len(ranks), tag)
    generator.version = trainer.version
    return {"bytes": max(s["bytes"] for s in stats), "strategy": strategy}
