"""A worker is one rank of the cluster: it holds the engines of the models its device group
hosts (data-parallel shards when the group has several ranks) and the generation replicas
of the models generated on its group, and runs what the driver dispatches to it.

The local backend runs one worker in this process; the Ray backend runs one per device as a
Ray actor. Both reach it only through `call(method, tag, *args)`, which also records a span
(the task's tag, start and end) for the trace.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.contract.protocols import (
    DataRank,
    EngineContext,
    GenerationEngine,
    ShardedGenerationEngine,
    ShardedTrainingEngine,
    TrainingEngine,
)
from flowrl.errors import BackendError
from flowrl.runtime.dispatch import ALL_EACH, ALL_FIRST, ALL_MEAN, ALL_NONE, ROWS, ROWS_EVEN, dispatch

if TYPE_CHECKING:
    from flowrl.contract.plan import ExecutionPlan
    from flowrl.graph.ir import ModelDecl
    from flowrl.plugins.manager import Entry, Registry
    from flowrl.runtime.schedule import Schedule

#: How long a collective waits for a peer before it fails (a dead peer otherwise hangs it).
COLLECTIVE_TIMEOUT_S = 120


def init_order(models: Mapping[str, ModelDecl]) -> list[str]:
    """Models in an order where each comes after the model it initialises from."""
    done: list[str] = []
    pending = list(models)
    while pending:
        name = next(m for m in pending if models[m].init_from is None or models[m].init_from in done)
        done.append(name)
        pending.remove(name)
    return done


def checked(engine: Any, protocol: type, entry: Entry, model: str) -> Any:
    """``engine`` if it implements ``protocol``; else a BackendError naming the engine and its plugin."""
    if isinstance(engine, protocol):
        return engine
    members = [m for m in protocol.__annotations__ if not m.startswith("_")]
    members += [m for m, v in vars(protocol).items() if callable(v) and not m.startswith("_")]
    missing = sorted({m for m in members if not hasattr(engine, m)})
    raise BackendError(
        f"{entry.name!r} (plugin '{entry.plugin}') built {type(engine).__name__} for model '{model}', which is not "
        f"a {protocol.__name__}: it lacks {', '.join(missing) or 'the protocol'} (see flowrl/contract/protocols.py)."
    )


def _takes(method: Any, keyword: str) -> bool:
    """Whether ``method`` accepts the keyword argument ``keyword`` (by name or through ``**kwargs``)."""
    import inspect

    params = inspect.signature(method).parameters.values()
    return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def built_by(entry: Entry, ctx: EngineContext) -> Any:
    """The engine ``entry``'s factory builds for ``ctx``; what the factory raises (beyond flowrl's own
    errors) becomes a BackendError naming the engine, its plugin and the model."""
    from flowrl.errors import FlowRLError

    try:
        return entry.obj(ctx)
    except FlowRLError:
        raise
    except Exception as exc:
        hint = ""
        if isinstance(exc, AttributeError) and "'plan'" in str(exc):
            hint = (
                " Engines no longer receive the plan: ctx.spec holds what the planner resolved for the model "
                "(checkpoint, seed, sampling, optimizer, numerics; see flowrl/contract/protocols.py EngineContext)."
            )
        raise BackendError(
            f"engine '{entry.name}' (plugin '{entry.plugin}') failed to build model '{ctx.decl.name}': "
            f"{type(exc).__name__}: {exc}.{hint}"
        ) from exc


def _seed_for(seed: int, model: str) -> None:
    import torch

    torch.manual_seed(seed + zlib.crc32(model.encode()))


def _split_replicas(plan: ExecutionPlan, schedule: Schedule) -> dict[str, list[tuple[int, ...]]]:
    """The ranks of each generation replica split tp > 1 (tp consecutive ranks of its generation group),
    by model, for the models that do not sample with their training engine in place."""
    from flowrl.runtime import dispatch

    assert plan.layout is not None
    out = {}
    for m in schedule.models:
        tp = plan.layout.generation_of(m.model).tp
        if m.generation_group is None or m.in_place or tp == 1:
            continue
        out[m.model] = dispatch.replicas(schedule.group(m.generation_group).ranks, tp)
    return out


class Worker:
    """One rank: engines for the models of its group, generation replicas, sync state, spans."""

    def __init__(
        self,
        rank: int,
        world: int,
        registry: Registry | None = None,
        threads: int | None = None,
        device: str = "cpu",
    ) -> None:
        self.rank, self.world, self.device = rank, world, device
        self._registry = registry
        self.threads = threads
        self.trainers: dict[str, TrainingEngine] = {}
        self.generators: dict[str, GenerationEngine] = {}
        self.dp_groups: dict[str, Any] = {}  # device group -> process group of its ranks
        self.channels: dict[str, Any] = {}  # model -> process group (trainer's first rank + generation ranks)
        self.sparse: dict[str, Any] = {}  # model -> its SparseSync (what the last sync sent)
        self.bucketed: dict[str, Any] = {}  # model -> its BucketedSync (flat buffers kept between syncs)
        self.buffers: dict[str, dict[str, Any]] = {}
        # model -> (process group, rank in it, tp) of this rank's generation replica, where it is split tp > 1
        self.replicas: dict[str, tuple[Any, int, int]] = {}
        # model -> (which replica of its generation group this rank is in, how many there are)
        self.replica_of: dict[str, tuple[int, int]] = {}
        self.schedule: Schedule | None = None
        self._spans: list[tuple[str, float, float]] = []

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            from flowrl.plugins.manager import registry

            self._registry = registry()
        return self._registry

    # ------------------------------------------------------------ plumbing
    def call(self, method: str, tag: str, *args: Any) -> Any:
        t0 = time.time()
        try:
            return getattr(self, method)(*args)
        finally:
            self._spans.append((tag, t0, time.time()))

    def spans(self) -> list[tuple[str, float, float]]:
        out, self._spans = self._spans, []
        return out

    def pid(self) -> int:
        return os.getpid()

    def setup(
        self, models: Mapping[str, ModelDecl], plan: ExecutionPlan, schedule: Schedule, init_method: str | None
    ) -> dict[str, tuple[Any, Any]]:
        """Join the process group, make the groups' and channels' subgroups, build the engines.
        Returns (tokenizer, hf_config) of every model built here."""
        import torch

        from flowrl.runtime.compute import set_compute_threads

        if self.threads:  # the engines compute on the compute thread (flowrl.runtime.compute)
            set_compute_threads(self.threads)
        torch.manual_seed(plan.config.seed)
        self.schedule = schedule
        channels = {  # model -> ranks that take part in its weight sync (the trainer's first rank sends)
            m.model: sorted({schedule.ranks_of(m.model)[0], *schedule.generation_ranks(m.model)})
            for m in schedule.models
            if m.generation_group is not None and not m.in_place
        }
        for model, ranks in channels.items():
            if self.rank in ranks and len(ranks) == 1:
                self.channels[model] = None  # the trainer and its one replica share this process
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group(
                    "nccl" if self.device.startswith("cuda") else "gloo",
                    init_method=init_method,
                    rank=self.rank,
                    world_size=self.world,
                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                )
            # every rank creates every subgroup, in the same order (new_group is collective)
            for g in schedule.groups:
                pg = dist.new_group(list(g.ranks))
                if self.rank in g.ranks:
                    self.dp_groups[g.name] = pg
            for model, replica in _split_replicas(plan, schedule).items():  # generation replicas split tp > 1
                for i, ranks in enumerate(replica):
                    pg = dist.new_group(list(ranks))
                    if self.rank in ranks:
                        self.replicas[model] = (pg, ranks.index(self.rank), len(ranks))
                        self.replica_of[model] = (i, len(replica))
            for model, ranks in channels.items():
                if len(ranks) > 1:
                    pg = dist.new_group(ranks, backend="gloo")  # weights travel host to host
                    if self.rank in ranks:
                        self.channels[model] = pg
        return self._build(models, plan, schedule)

    def _build(
        self, models: Mapping[str, ModelDecl], plan: ExecutionPlan, schedule: Schedule
    ) -> dict[str, tuple[Any, Any]]:
        device = self.device
        assert plan.layout is not None
        built: dict[str, tuple[Any, Any]] = {}
        for name in init_order(models):
            place = schedule.placement(name)
            ranks = schedule.group(place.group).ranks
            if self.rank not in ranks:
                continue
            decl, run = models[name], plan.model_run(name)
            train = self.registry.entry("training_engines", run.training_engine, field="train.engine")
            _seed_for(run.seed, name)  # the same initial weights wherever the model is placed
            source = self.trainers.get(decl.init_from) if decl.init_from is not None else None
            if decl.init_from is not None and (source is None or len(schedule.ranks_of(decl.init_from)) > 1):
                # the source lives elsewhere or is sharded: a one-rank copy of its (identical) initial weights
                source = self._template(train, models[decl.init_from], plan, device)
            ctx = EngineContext(
                decl=decl,
                spec=plan.model_run(name),
                device=device,
                source=source,
                rank=ranks.index(self.rank),
                world=len(ranks),
                group=self.dp_groups.get(place.group),
                tp=plan.layout.layout(name).parallel.tp,
                pp=plan.layout.layout(name).parallel.pp,
                schedule=plan.layout.layout(name).schedule,
                virtual_stages=plan.layout.layout(name).virtual_stages,
                offload=plan.layout.layout(name).offload_optimizer,
                trust_remote_code=plan.config.trust_remote_code,
            )
            self.trainers[name] = checked(built_by(train, ctx), TrainingEngine, train, name)
            built[name] = (self.trainers[name].tokenizer, self.trainers[name].hf_config)
        for place in schedule.models:
            name = place.model
            if place.generation_group is None or self.rank not in schedule.group(place.generation_group).ranks:
                continue
            trainer = self.trainers.get(name)
            if place.in_place and isinstance(trainer, GenerationEngine):
                self.generators[name] = trainer
                continue
            # a replica of the model's initial weights; syncs bring it the trained ones
            run = plan.model_run(name)
            train = self.registry.entry("training_engines", run.training_engine, field="train.engine")
            gen = self.registry.entry("generation_engines", run.generation_engine or "", field="generation.engine")
            _seed_for(run.seed, name)
            template = self._template(train, models[name], plan, device)
            group, at, tp = self.replicas.get(name, (None, 0, 1))
            if run.generation_engine == run.training_engine and isinstance(template, GenerationEngine) and tp == 1:
                engine = template
            else:  # split tp > 1 over this rank's replica: each rank takes its slice of the template's weights
                spec = plan.model_run(name)
                ctx = EngineContext(
                    decl=models[name],
                    spec=spec,
                    device=device,
                    source=template,
                    rank=at,
                    world=tp,
                    group=group,
                    tp=tp,
                    trust_remote_code=plan.config.trust_remote_code,
                )
                engine = built_by(gen, ctx)
            self.generators[name] = checked(engine, GenerationEngine, gen, name)
            if self.channels.get(name) is not None and self.rank != schedule.ranks_of(name)[0]:
                # what syncs receive into: the trainer's export format (names, shapes, dtypes), which the
                # generation engine's own layout (fused, repacked, another dtype) need not match
                self.buffers[name] = {k: v.detach().clone() for k, v in template.export_weights().items()}
            built.setdefault(name, (template.tokenizer, template.hf_config))
        return built

    def _template(self, train: Entry, decl: ModelDecl, plan: ExecutionPlan, device: str) -> Any:
        """A one-rank, frozen copy of ``decl``'s initial weights (models build deterministically from the seed)."""
        frozen = msgspec.structs.replace(decl, trainable=False, init_from=None)
        spec = msgspec.structs.replace(plan.model_run(decl.name), optimizer=None)
        trust = plan.config.trust_remote_code
        return checked(
            built_by(train, EngineContext(decl=frozen, spec=spec, device=device, trust_remote_code=trust)),
            TrainingEngine,
            train,
            decl.name,
        )

    # ------------------------------------------------------------ engine calls
    @dispatch(ROWS_EVEN)
    def forward(self, model: str, seqs: Any, output: str, micro: int) -> Any:
        return self.trainers[model].forward(seqs, output, micro)

    @dispatch(ALL_MEAN)
    def train(self, model: str, loss: Any, batch: dict[str, Any], step: Any) -> dict[str, float]:
        return self.trainers[model].train(loss, batch, step)

    @dispatch(ROWS)
    def generate(
        self,
        model: str,
        prompts: Sequence[Any],
        n: int,
        greedy: bool,
        seed: int,
        max_new: int | None,
        temperature: float | None = None,
    ) -> Any:
        import torch

        g = torch.Generator().manual_seed(seed)
        engine = self.generators[model]
        extra = {} if temperature is None else {"temperature": temperature}  # engines before it take none
        if extra and not _takes(engine.generate, "temperature"):
            raise BackendError(
                f"model '{model}': eval.temperature {temperature} differs from rollout.temperature, and its "
                f"generation engine {type(engine).__name__}.generate takes no `temperature` (see "
                "flowrl/contract/protocols.py: GenerationEngine). Add that keyword to the engine, or evaluate "
                "at rollout.temperature."
            )
        return engine.generate(prompts, n=n, greedy=greedy, generator=g, max_new_tokens=max_new, **extra)

    @dispatch(ROWS)
    def resume(self, model: str, rollout: Any, seed: int, max_new: int | None) -> Any:
        import torch

        g = torch.Generator().manual_seed(seed)
        return self.generators[model].resume(rollout, generator=g, max_new_tokens=max_new)

    @dispatch(ALL_NONE)
    def load_weights(self, model: str, weights: Mapping[str, Any], version: int) -> None:
        self.generators[model].load_weights(weights, version)

    @dispatch(ALL_FIRST)
    def export_weights(self, model: str) -> dict[str, Any]:
        return self.trainers[model].export_weights()

    @dispatch(ALL_NONE)
    def import_weights(self, model: str, weights: Mapping[str, Any]) -> None:
        self.trainers[model].import_weights(weights)

    @dispatch(ALL_NONE)
    def save_state(self, model: str, path: Any) -> None:
        self.trainers[model].save_state(path)

    @dispatch(ALL_FIRST)
    def load_state(self, model: str, path: Any) -> int:
        return self.trainers[model].load_state(path)

    @dispatch(ALL_NONE)
    def save(self, model: str, path: Any) -> None:
        self.trainers[model].save(path)

    def generation_weights(self, model: str) -> dict[str, Any]:
        """What the generation side samples with (for checks): its engine's exported weights."""
        engine = self.generators[model]
        export = getattr(engine, "export_weights", None)
        if export is None:
            raise BackendError(f"the generation engine of model '{model}' cannot export its weights.")
        return export()

    # ------------------------------------------------------------ weight sync
    @dispatch(ALL_EACH)
    def sync(self, model: str, strategy: str, version: int) -> dict[str, float]:
        """Move ``model``'s trained weights into its generation replicas by ``strategy``. Every rank of
        the model's group and of its generation group calls this."""
        from flowrl.runtime import weightsync

        assert self.schedule is not None
        t0 = time.perf_counter()
        trainer_ranks = self.schedule.ranks_of(model)
        if strategy == "reshard" and self._same_split(model):  # colocated, split alike: each rank its own slices
            trainer, engine = self.trainers[model], self.generators[model]
            assert isinstance(trainer, ShardedTrainingEngine) and isinstance(engine, ShardedGenerationEngine)
            shards = trainer.export_local_shards()
            engine.load_local_shards(shards, version)
            return {"bytes": weightsync.state_bytes(shards), "seconds": time.perf_counter() - t0}
        weights = self.trainers[model].export_weights() if self.rank in trainer_ranks else None
        sent = 0
        if strategy == "reshard":  # colocated: every rank all-gathered the full weights; load them in place
            if model in self.generators:
                self.generators[model].load_weights(weights, version)
                sent = weightsync.state_bytes(weights)
            return {"bytes": sent, "seconds": time.perf_counter() - t0}
        src = trainer_ranks[0]
        if model not in self.channels:
            return {"bytes": 0, "seconds": time.perf_counter() - t0}
        group = self.channels[model]
        state = weights if self.rank == src else self.buffers[model]
        if group is None:  # trainer and the one generation rank are the same process
            self.generators[model].load_weights(state, version)
            return {"bytes": 0, "seconds": time.perf_counter() - t0}
        if strategy == "full":
            sent = weightsync.sync_full(state, src, group)
        elif strategy == "bucketed":
            sent = self.bucketed.setdefault(model, weightsync.BucketedSync())(state, src, group)
        elif strategy == "sparse":
            sent = self.sparse.setdefault(model, weightsync.SparseSync())(state, src, group)
        else:
            raise BackendError(f"weight sync strategy '{strategy}' is not one this worker runs.")
        if model in self.generators:  # on the sender, state is its exported weights
            self.generators[model].load_weights(state, version)
        return {"bytes": sent, "seconds": time.perf_counter() - t0}

    def _same_split(self, model: str) -> bool:
        """Whether ``model``'s generation replica on this rank is cut as its training engine's weights are
        (both declare the same `shard_layout`, over the same ranks): then a sync moves each rank's own pieces."""
        assert self.schedule is not None
        trainer, engine = self.trainers.get(model), self.generators.get(model)
        place = self.schedule.placement(model)
        if place.generation_group != place.group or not isinstance(trainer, ShardedTrainingEngine):
            return False
        if not isinstance(engine, ShardedGenerationEngine):
            return False
        layout = trainer.shard_layout()
        return layout is not None and layout == engine.shard_layout()

    @dispatch(ALL_EACH)
    def data_rank(self, model: str, side: str) -> DataRank:
        """Which share of a call's rows this rank computes for ``model``'s training engine (``side``
        "train") or its generation replica ("generate"): what the engine declares
        (`ShardedTrainingEngine.data_rank`); a generation replica split over several ranks, its replica;
        otherwise this rank is a shard of its own."""
        assert self.schedule is not None
        if side == "train":
            trainer = self.trainers[model]
            if isinstance(trainer, ShardedTrainingEngine):
                return trainer.data_rank()
            ranks = self.schedule.ranks_of(model)
            return DataRank(index=list(ranks).index(self.rank), count=len(ranks))
        engine = self.generators[model]
        if model in self.replica_of:
            index, count = self.replica_of[model]
            return DataRank(index=index, count=count)
        if engine is self.trainers.get(model) and isinstance(engine, ShardedTrainingEngine):  # sampling in place
            return engine.data_rank()
        ranks = list(self.schedule.generation_ranks(model))
        return DataRank(index=ranks.index(self.rank), count=len(ranks))

    def close_engines(self) -> None:
        """Release what engines hold outside this process (an engine's own processes, shared memory):
        every engine with a ``close`` method is closed once. Errors are ignored (the run is ending)."""
        seen: set[int] = set()
        for engine in (*self.generators.values(), *self.trainers.values()):
            close = getattr(engine, "close", None)
            if close is None or id(engine) in seen:
                continue
            seen.add(id(engine))
            try:
                close()
            except Exception:  # noqa: BLE001 - best effort at the end of a run
                pass

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
