"""The passes a single-machine plan needs. Each is a plain function ``(ctx, plan) -> plan``.

resolve     -> every function/loss/task a node names exists, with the keys it needs
place       -> every model on the local device (colocated, like verl's hybrid engine)
micro_batch -> micro-batch size per node (configured, or the largest that fits)
memory      -> per-device memory estimate; refuses a plan that cannot fit, with numbers
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from flowrl.errors import PlanError
from flowrl.graph.ir import Compute, Forward, Generate, Graph, Reward, Train
from flowrl.planner import memory as mem
from flowrl.planner.plan import Device, ExecutionPlan, MemoryEstimate, ModelPlacement, NodePlan
from flowrl.plugins.manager import Registry


@dataclass
class PlanContext:
    """What passes may consult besides the plan: the graph, plugins, the base model's config."""

    graph: Graph
    registry: Registry
    cache: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # e.g. autotune budget_s, seed

    def model_config(self, plan: ExecutionPlan) -> Any:
        if "config" not in self.cache:
            from flowrl.backends.local.models import load_tokenizer, model_config

            cfg = plan.config
            self.cache["config"] = model_config(cfg.model, cfg.tiny_model, load_tokenizer(cfg.model))
        return self.cache["config"]


def _replace(plan: ExecutionPlan, **changes: Any) -> ExecutionPlan:
    return msgspec.structs.replace(plan, **changes)


# ------------------------------------------------------------------ resolve


def resolve(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Check that every task, function and loss a node names exists and gets the keys it needs."""
    from flowrl.tasks.builtin import make_task

    reg = ctx.registry
    cfg = plan.config
    task = make_task(cfg.task, cfg.task_options, registry={e.name: e.obj for e in reg.entries("tasks")})
    for node in ctx.graph.nodes.values():
        if isinstance(node, Reward):
            reg.entry("reward_functions", node.fn)
        elif isinstance(node, Compute):
            entry = reg.entry("advantage_estimators", node.fn)
            _check_keys(node.name, f"compute function '{node.fn}'", node.reads, node.writes, entry.meta)
        elif isinstance(node, Train):
            entry = reg.entry("losses", node.loss)
            _check_keys(node.name, f"loss '{node.loss}'", node.reads, (), entry.meta)
            decl = ctx.graph.models[node.model]
            want = "values" if decl.scalar_head else "logprobs"
            if entry.meta.get("output", "logprobs") != want:
                raise PlanError(f"node '{node.name}': loss '{node.loss}' trains on {entry.meta.get('output')}, but model '{decl.name}' (role {decl.role}) produces {want}.")
    reg.entry("backends", plan.backend)
    rollout = cfg.rollout
    if rollout.max_new_tokens is None:
        rollout = msgspec.structs.replace(rollout, max_new_tokens=task.max_new_tokens())
    return _replace(plan, config=msgspec.structs.replace(cfg, rollout=rollout))


def _check_keys(node: str, what: str, reads: tuple[str, ...], writes: tuple[str, ...], meta: dict[str, Any]) -> None:
    for key in meta.get("needs", ()):
        if key not in reads:
            raise PlanError(f"node '{node}': {what} needs key '{key}', but the node does not read it. Add '{key}' to its reads.")
    gives = meta.get("gives")
    if gives is not None:
        for key in writes:
            if key not in gives:
                raise PlanError(f"node '{node}' writes key '{key}', but {what} only produces {', '.join(gives)}.")


# ------------------------------------------------------------------ place


def place(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Place every model on the local device (colocated) and size its state."""
    cfg = plan.config
    device = cfg.device
    if device == "auto":
        import torch

        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = "cuda:0"
    if device != "cpu" and not device.startswith("cuda:"):
        raise PlanError(f"config field 'device' is {cfg.device!r}; the local backend runs on 'cpu', 'cuda', 'cuda:N' or 'auto'.")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise PlanError(f"config field 'device' is {cfg.device!r} but torch sees no CUDA device here. Use --set device=cpu.")
    capacity = int(cfg.memory_limit_gib * mem.GiB) if cfg.memory_limit_gib else mem.device_capacity(device)
    from flowrl.backends.local.models import count_parameters

    parameters = count_parameters(ctx.model_config(plan))
    models = []
    for decl in ctx.graph.models.values():
        params = parameters + (ctx.model_config(plan).hidden_size + 1 if decl.scalar_head else 0)
        models.append(ModelPlacement(model=decl.name, device=device, dtype="float32", parameters=params, trainable=decl.trainable, state_bytes=mem.state_bytes(params, "float32", decl.trainable)))
    return _replace(plan, devices=(Device(name=device, memory_bytes=capacity, threads=cfg.threads),), models=tuple(models))


# ------------------------------------------------------------------ micro_batch


def node_rows(graph: Graph, prompts: int) -> dict[str, int]:
    """Sequences each node sees per step, propagated along keys from the graph inputs."""
    key_rows = {key: prompts for key in graph.inputs}
    out: dict[str, int] = {}
    for name in graph.order():
        node = graph.nodes[name]
        rows = max((key_rows.get(k, prompts) for k in node.reads), default=prompts)
        if isinstance(node, Generate):
            rows = rows * (1 if node.greedy else node.n)
        out[name] = rows
        for key in node.writes:
            key_rows[key] = rows
    return out


def micro_batch(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Choose each node's micro-batch size: configured, or the largest whose activations fit."""
    cfg = plan.config
    config = ctx.model_config(plan)
    seq_len = _seq_len(ctx, plan)
    placement = {m.model: m for m in plan.models}
    states = sum(m.state_bytes for m in plan.models)
    budget = max(plan.devices[0].memory_bytes - states, 0) // 2  # keep half the headroom for the rest
    nodes = []
    for name, rows in node_rows(ctx.graph, cfg.rollout.prompts_per_step).items():
        node = ctx.graph.nodes[name]
        device = placement[node.model].device if node.model else None
        size = rows
        if isinstance(node, (Forward, Train)):
            if cfg.train.micro_batch_size is not None:
                size = min(cfg.train.micro_batch_size, rows)
            else:
                training = isinstance(node, Train)
                while size > 1 and mem.activation_bytes(config, size, seq_len, training=training) > budget:
                    size = (size + 1) // 2
        nodes.append(NodePlan(node=name, kind=node.kind, device=device, rows=rows, micro_batch_size=size))
    return _replace(plan, nodes=tuple(nodes))


def _seq_len(ctx: PlanContext, plan: ExecutionPlan) -> int:
    prompt = int(ctx.cache.get("prompt_len", 16))
    return prompt + int(plan.config.rollout.max_new_tokens or 16)


# ------------------------------------------------------------------ memory


def memory(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Estimate each device's peak memory; verification refuses a plan that does not fit."""
    config = ctx.model_config(plan)
    seq_len = _seq_len(ctx, plan)
    estimates = []
    for device in plan.devices:
        breakdown: dict[str, int] = {}
        for m in plan.models:
            if m.device == device.name:
                breakdown[f"model {m.model} ({'weights+grads+adam' if m.trainable else 'weights'})"] = m.state_bytes
        peak_act, peak_node = 0, ""
        for n in plan.nodes:
            if n.device != device.name:
                continue
            if n.kind == "generate":
                need = mem.kv_cache_bytes(config, n.rows, seq_len) + mem.activation_bytes(config, n.rows, 1, training=False)
            elif n.kind in ("forward", "train"):
                need = mem.activation_bytes(config, n.micro_batch_size, seq_len, training=n.kind == "train")
            else:
                continue
            if need > peak_act:
                peak_act, peak_node = need, n.node
        if peak_node:
            breakdown[f"activations (peak: node {peak_node})"] = peak_act
        required = sum(breakdown.values())
        estimates.append(MemoryEstimate(device=device.name, capacity_bytes=device.memory_bytes, required_bytes=required, breakdown=breakdown))
    return _replace(plan, memory=tuple(estimates))


# ------------------------------------------------------------------ autotune (cluster plans)


def autotune(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Search placements, parallel sizes, rollout policy and weight sync for the target cluster."""
    if plan.target is None:
        return plan
    from flowrl.planner.autotune import Tuner

    t = plan.target
    tuner = Tuner(ctx.graph, t.model, t.cluster, t.workload, seed=int(ctx.options.get("seed", 0)), cost_model=ctx.options.get("cost_model", "analytic"), registry=ctx.registry)
    result = tuner.search(budget_s=float(ctx.options.get("budget_s", 8.0)))
    ctx.cache["tune"] = result
    return _replace(plan, cluster=result.best)


def verify_cluster_plan(graph: Graph, plan: ExecutionPlan) -> None:
    """Every model placed, parallel sizes fill their group and divide heads, layers and batch, memory fits."""
    c, t = plan.cluster, plan.target
    if c is None or t is None:
        return
    if sorted(m.model for m in c.models) != sorted(graph.models):
        raise PlanError(f"cluster plan places {sorted(m.model for m in c.models)} but the graph declares {sorted(graph.models)}.")
    if sum(g.devices for g in c.groups) > t.cluster.devices:
        raise PlanError(f"cluster plan uses {sum(g.devices for g in c.groups)} devices; the cluster has {t.cluster.devices}.")
    groups = {g.name: g for g in c.groups}
    for m in c.models:
        p, g = m.parallel, groups.get(m.group)
        if g is None:
            raise PlanError(f"model '{m.model}' is placed on unknown group '{m.group}'.")
        if p.dp * p.tp * p.pp != g.devices:
            raise PlanError(f"model '{m.model}': dp {p.dp} x tp {p.tp} x pp {p.pp} != {g.devices} devices of group '{g.name}'.")
        if t.model.heads % p.tp or t.model.layers % p.pp:
            raise PlanError(f"model '{m.model}': tp {p.tp} must divide {t.model.heads} heads and pp {p.pp} the {t.model.layers} layers.")
        if (t.workload.sequences // t.workload.mini_batches) % (p.dp * m.micro_batch):
            raise PlanError(f"model '{m.model}': dp {p.dp} x micro-batch {m.micro_batch} does not divide the mini-batch of {t.workload.sequences // t.workload.mini_batches} sequences.")
    gen = c.generation
    if gen.tp * gen.replicas != groups[gen.group].devices or t.model.heads % gen.tp:
        raise PlanError(f"generation: tp {gen.tp} x {gen.replicas} replicas must fill group '{gen.group}' and tp must divide the heads.")
    if c.predicted is not None:
        cap = t.cluster.hardware.memory_bytes
        for g, need in c.predicted.memory_bytes.items():
            if need > cap:
                raise PlanError(f"group '{g}' needs {mem.gib(need)} per device; a {t.cluster.hardware.name} has {mem.gib(cap)}.")


# ------------------------------------------------------------------ verification


def verify_plan(graph: Graph, plan: ExecutionPlan) -> None:
    """Invariants of whatever the plan holds so far; raises PlanError."""
    verify_cluster_plan(graph, plan)
    devices = {d.name for d in plan.devices}
    if plan.models:
        placed = [m.model for m in plan.models]
        if sorted(placed) != sorted(graph.models):
            raise PlanError(f"plan places models {sorted(placed)} but the graph declares {sorted(graph.models)}.")
        for m in plan.models:
            if m.device not in devices:
                raise PlanError(f"model '{m.model}' is placed on unknown device '{m.device}' (devices: {', '.join(sorted(devices))}).")
    if plan.nodes:
        planned = [n.node for n in plan.nodes]
        if sorted(planned) != sorted(graph.nodes):
            raise PlanError(f"plan covers nodes {sorted(planned)} but the graph has {sorted(graph.nodes)}.")
        for n in plan.nodes:
            if not 1 <= n.micro_batch_size <= max(n.rows, 1):
                raise PlanError(f"node '{n.node}': micro-batch size {n.micro_batch_size} is outside 1..{n.rows} (its rows per step).")
    for est in plan.memory:
        if est.required_bytes > est.capacity_bytes:
            parts = "; ".join(f"{k}: {mem.gib(v)}" for k, v in sorted(est.breakdown.items(), key=lambda kv: -kv[1]))
            raise PlanError(
                f"the plan needs {mem.gib(est.required_bytes)} on device '{est.device}' but only {mem.gib(est.capacity_bytes)} is available "
                f"(short by {mem.gib(est.required_bytes - est.capacity_bytes)}). Breakdown: {parts}. "
                "Use a smaller model, fewer prompts_per_step/samples_per_prompt, a smaller train.micro_batch_size, or a multi-device backend."
            )


DEFAULT_PIPELINE = ("resolve", "place", "micro_batch", "memory")
CLUSTER_PIPELINE = ("resolve", "autotune")
BUILTIN_PASSES = {"resolve": resolve, "place": place, "micro_batch": micro_batch, "memory": memory, "autotune": autotune}
