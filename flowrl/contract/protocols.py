"""The runtime boundary: what a backend implements.

- A **training engine** holds one graph model (actor, critic, reference, reward model) and
  runs its forward passes (token log-probs, token values, sequence scores) and train steps;
  it exports and imports weights and saves its state.
- A **generation engine** samples ``n`` responses per prompt with per-token log-probs, takes
  new weights after a train step, and can stop early and resume unfinished sequences from
  the tokens generated so far. An engine holding processes or shared memory of its own may
  define ``close()``; the run calls it once at the end, before its workers stop.
- An **executor** runs a plan. It says up front (``check``) whether it can: what it cannot run
  is a `PlanError` naming the feature, raised before any model is built. What the run's
  timeline is compared with comes from a `Predictor` its caller passes (`flowrl.contract.predict`).
  A worker or node it loses mid-run is a `WorkerLostError`; its caller restarts the run from the
  last checkpoint inside one ``session`` (`flowrl.runtime.recovery`).

Engines are chosen per role in the run config (``generation.engine``, ``train.engine``), so a
plugin may supply only generation. Plugins register them through the hooks
``register_executors``, ``register_generation_engines`` and ``register_training_engines``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch
    from torch import Tensor

    from flowrl.contract.capabilities import Capabilities
    from flowrl.contract.data import Prompt, Rollout, Sequences, StepBatch
    from flowrl.contract.plan import ExecutionPlan
    from flowrl.contract.predict import Predictor
    from flowrl.contract.resolved import ModelRun
    from flowrl.graph.ir import Graph, ModelDecl
    from flowrl.specs import AlgoConfig

Batch = Mapping[str, Any]
#: ``loss(outputs, batch, algo) -> (loss tensor, stats)``; outputs are the model's log-probs or values.
LossFn = Callable[["Tensor", Batch, "AlgoConfig"], "tuple[Tensor, dict[str, float]]"]


@dataclass(frozen=True)
class EngineContext:
    """What an engine factory receives: the model, what the planner resolved for it, where it runs.

    ``spec``: the model's resolved `ModelRun` (checkpoint or tiny shape, seed, sampling, optimizer,
    numerics). ``source``: for a training engine, the engine whose weights it starts from
    (``init_from``), None for the base checkpoint or a fresh tiny model; for a generation engine,
    the training engine of the same model, whose ``tokenizer``, ``hf_config`` and
    ``export_weights()`` it starts from.
    """

    decl: ModelDecl
    spec: ModelRun
    device: str
    source: Any = None
    rank: int = 0  # rank among the ranks of the model's device group
    world: int = 1  # ranks of that group; a training engine with world > 1 shards the model
    group: Any = None  # the group's torch.distributed process group (None: one rank)
    # the model's tensor-parallel size in its training layout, or a generation engine's in its replica, whose
    # ranks are then ``group``'s (for engines that declare model_parallel)
    tp: int = 1
    # the model's pipeline layout (training engines that declare pipeline_parallel): ``pp`` pipeline ranks
    # (outermost: rank // (world // pp)), run by ``schedule`` (gpipe, 1f1b, interleaved) with
    # ``virtual_stages`` stages per rank
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    # the layout keeps the model's optimizer states in host memory between steps (for engines that
    # declare optimizer_offload)
    offload: bool = False
    # the run allows a model folder's own Python (config.json / tokenizer_config.json auto_map):
    # RunConfig.trust_remote_code, set by `flowrl run --trust-remote-code`
    trust_remote_code: bool = False


@dataclass(frozen=True)
class TrainStep:
    """How one train node updates its model: PPO-style epochs x mini-batches, each mini-batch
    one optimizer step accumulated over micro-batches."""

    node: str
    sequences_key: str
    output: str  # "logprobs" or "values": what the loss consumes
    micro_batch: int
    epochs: int
    mini_batches: int
    algo: AlgoConfig
    generator: torch.Generator = field(repr=False)
    # what the loss is a mean over (flowrl.specs.LOSS_UNITS): the engine weighs each micro-batch's
    # loss by its share of the mini-batch's tokens or rows (or by 1, a sum)
    unit: str = "token-mean"
    # ports the step computes itself: the model's outputs of each micro-batch, detached, under these
    # names in the batch the loss reads (the old log-probs of one update per batch, fused by the planner
    # only for an engine declaring `EngineCapabilities.own_outputs`; `flowrl.contract.reading.fusable`)
    own: tuple[str, ...] = ()
    # rows the loss reads together (a preference pair: chosen, then rejected; a loss registered with
    # ``group=2``): consecutive rows the engine shuffles, micro-batches and splits only as whole groups
    group: int = 1


@runtime_checkable
class TrainingEngine(Protocol):
    decl: ModelDecl
    tokenizer: Any
    hf_config: Any
    version: int  # train steps taken

    def forward(self, seqs: Sequences, output: str, micro_batch: int) -> Tensor:
        """[B, R] log-probs or values aligned with response tokens, or [B] scores."""
        ...

    def train(self, loss: LossFn, batch: StepBatch, step: TrainStep) -> dict[str, float]:
        """Update the model; returns mean stats (loss, grad_norm and the loss's own). A batch may
        hold no rows (a filter that keeps rows kept none): take no optimizer step, but count the
        version as a step, like every other train call."""
        ...

    def export_weights(self) -> dict[str, Tensor]: ...

    def import_weights(self, weights: Mapping[str, Tensor]) -> None: ...

    def save_state(self, path: Path) -> None:
        """Everything needed to resume into folder ``path`` (safetensors and JSON, no pickle): the
        HF checkpoint, optimizer state, version. Every rank of the group calls it."""
        ...

    def load_state(self, path: Path) -> int:
        """Restore what `save_state` wrote (each rank its shard); returns the version."""
        ...

    def save(self, path: Path) -> None:
        """An HF-format checkpoint (model and tokenizer) a later run can start from."""
        ...


@runtime_checkable
class GenerationEngine(Protocol):
    version: int  # the weight version it samples with
    resumable: bool  # whether `resume` continues unfinished rows

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int,
        greedy: bool,
        generator: torch.Generator,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
    ) -> Rollout:
        """``n`` samples per prompt (rows grouped by prompt); stops after ``max_new_tokens``
        (default: the run's budget), leaving rows without EOS unfinished. ``temperature`` (given only
        by evaluation, and only when it differs from the run's) replaces the sampling temperature."""
        ...

    def resume(self, rollout: Rollout, *, generator: torch.Generator, max_new_tokens: int | None = None) -> Rollout:
        """Continue the unfinished rows of ``rollout`` from the tokens generated so far."""
        ...

    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Take new weights (after a train step); later samples use them."""
        ...


class DataRank(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Which share of a call's rows one rank of a group computes: shard ``index`` of ``count`` (the
    group's rows are cut into ``count`` contiguous shards; ranks of one shard compute the same rows,
    e.g. the tensor-parallel ranks of one copy of a model, and the first of them answers)."""

    index: int = 0
    count: int = 1


@runtime_checkable
class ShardedTrainingEngine(TrainingEngine, Protocol):
    """A training engine that says how its group's ranks share data and weights. An engine that does not
    declare these is data parallel rank by rank (each rank its own shard) and exports whole weights."""

    def data_rank(self) -> DataRank:
        """Which share of a call's rows this rank computes."""
        ...

    def shard_layout(self) -> str | None:
        """How `export_local_shards` cuts the weights (a generation engine whose `shard_layout` is the same,
        on the same ranks, loads them as they are); None: it exports whole weights only."""
        ...

    def export_local_shards(self) -> dict[str, Tensor]:
        """This rank's own pieces of the weights, cut as `shard_layout` says; every rank of the group calls it."""
        ...


@runtime_checkable
class ShardedGenerationEngine(GenerationEngine, Protocol):
    """A generation engine split over several ranks that takes each rank's own pieces of the weights."""

    def shard_layout(self) -> str | None:
        """How the weights it holds on this rank are cut (`ShardedTrainingEngine.shard_layout`); None: whole."""
        ...

    def load_local_shards(self, shards: Mapping[str, Tensor], version: int) -> None:
        """Take `ShardedTrainingEngine.export_local_shards` of a model cut the same way, in place."""
        ...


@dataclass
class RunResult:
    out_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # evaluation records (eval.every), by step
    checkpoints: dict[str, Path] = field(default_factory=dict)  # model -> its final HF checkpoint
    last_checkpoint: Path | None = None  # the newest step checkpoint (what --resume continues from)
    resumed_from: int | None = None  # the first step this invocation ran, when it resumed
    stopped: int | None = None  # the last step run when Ctrl-C / SIGTERM stopped the run early
    # one record per restart after a lost worker or node (flowrl.runtime.recovery), as metrics.jsonl has it
    restarts: list[dict[str, Any]] = field(default_factory=list)


@runtime_checkable
class Executor(Protocol):
    capabilities: Capabilities

    def check(self, graph: Graph, plan: ExecutionPlan) -> None:
        """Raise PlanError naming what this executor cannot run; builds nothing."""
        ...

    def run(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        out_dir: Path,
        *,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        resume: bool = False,
        predictor: Predictor | None = None,
        events: Sequence[dict[str, Any]] = (),
    ) -> RunResult:
        """Run a plan that passed ``check`` in ``out_dir``; with ``resume``, continue the run there
        from its newest checkpoint. ``predictor``: what the run's timeline is drawn against (None:
        the measured timeline alone). ``events``: records (``{"kind": "restart", "step": S, ...}``)
        written to metrics.jsonl once it holds the steps the run continues after."""
        ...

    def session(self) -> AbstractContextManager[None]:
        """Keeps what `run` connects to (a cluster) across the runs inside it: the restarts of one run."""
        ...

    def devices(self, plan: ExecutionPlan) -> int | None:
        """How many devices of the kind ``plan`` runs on the executor could place now (None: it cannot tell)."""
        ...
