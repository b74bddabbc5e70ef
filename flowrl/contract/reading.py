"""What a plan and its graph say, read the same way by the planner that writes the plan and the
executor that runs it: the models that generate, each model's response budget and checkpoint
folder, which forward nodes a train step may compute itself, and the invariants every plan holds
(`verify_plan`)."""

from __future__ import annotations

from pathlib import Path

from flowrl.contract.checked import gib
from flowrl.contract.model import check_model_keys
from flowrl.contract.plan import ExecutionPlan
from flowrl.contract.resolved import NodeOptions
from flowrl.errors import PlanError
from flowrl.graph.ir import Forward, Generate, Graph, Train
from flowrl.specs import model_folders


def generating_models(graph: Graph) -> list[str]:
    """The models generate nodes sample from, in declaration order."""
    return list(dict.fromkeys(n.model for n in graph.nodes.values() if isinstance(n, Generate)))


def episode_budget(graph: Graph, model: str, budget: int) -> int:
    """The response budget of ``model``'s engines: ``budget``, or more for a generate node of its with
    separate budgets for model turns and environment text (``turns * turn_tokens + env_tokens``)."""
    for node in graph.nodes.values():
        if isinstance(node, Generate) and node.model == model and node.env_tokens is not None:
            budget = max(budget, node.turns * (node.turn_tokens or 1) + node.env_tokens)
    return budget


def model_checkpoints(graph: Graph, model: str | None) -> dict[str, str | None]:
    """Each graph model's HF folder (absolute; None: the fresh tiny model) from config field
    ``model``: one folder for every model, or per model (``actor=DIR,rm=DIR2``, parsed by
    `flowrl.specs.model_folders`; keys are graph model names or roles). A model takes, in order:
    the entry of its name; of its role; its ``init_from`` model's folder (a reference or critic
    starts where its actor does); the bare (default) entry; the first actor's folder. So models
    are fresh tiny ones only where no folder reaches them: ``reward=RM`` alone gives a tiny actor
    (and reference, critic) and the reward model RM. A key naming neither a graph model nor one of
    its roles is refused."""

    def absolute(folder: str | None) -> str | None:
        return None if folder is None else str(Path(folder).expanduser().resolve())

    default, named = model_folders(model)
    default = absolute(default)
    if not named:
        return {name: default for name in graph.models}
    check_model_keys(named, {m: d.role for m, d in graph.models.items()}, f"config field 'model' ('{model}')")
    named = {key: absolute(folder) for key, folder in named.items()}
    actor = next((m for m, d in graph.models.items() if d.role == "actor"), None)
    out: dict[str, str | None] = {}

    def folder(name: str, seen: tuple[str, ...]) -> str | None:
        if name not in out:
            decl = graph.models[name]
            source = decl.init_from if decl.init_from in graph.models and decl.init_from not in seen else None
            if name in named or decl.role in named:
                out[name] = named.get(name, named.get(decl.role))
            elif source is not None:
                out[name] = folder(source, (*seen, name))
            elif default is not None or actor is None or name == actor:
                out[name] = default
            else:
                out[name] = folder(actor, (*seen, name))
        return out[name]

    return {name: folder(name, ()) for name in graph.models}


def lora_on_fresh_weights(plan: ExecutionPlan) -> list[str]:
    """A warning per model that trains LoRA adapters over a freshly initialised tiny model (no
    checkpoint): low-rank updates of random weights learn little (the default graph's reward went
    0.01 -> 0.02 in 200 steps where full training reaches 0.66). LoRA adapts a trained model."""
    return [
        f"model '{name}' trains LoRA adapters (train.lora.rank={run.lora.rank}) over a fresh tiny model with random "
        "weights, which learns little. Train it whole first (train.lora.rank=0) and adapt its checkpoint "
        "(--model runs/NAME/checkpoint), or give --model a pretrained folder."
        for name, run in sorted(plan.models.items())
        if run.lora is not None and run.lora.rank > 0 and run.checkpoint is None and run.optimizer is not None
    ]


def fusable(graph: Graph, options: dict[str, NodeOptions]) -> dict[str, str]:
    """The forward -> train node pairs a fusion may join: a log-prob forward whose output only its
    model's one train node reads (no other update between them), on the sequences that node trains
    on, outside dynamic-sampling filter rounds, for a train node taking one update per batch."""
    readers: dict[str, list[str]] = {}
    for node in graph.nodes.values():
        for key in node.reads:
            readers.setdefault(key, []).append(node.name)
    trains: dict[str, list[str]] = {}
    for node in graph.nodes.values():
        if isinstance(node, Train):
            trains.setdefault(node.model, []).append(node.name)
    in_rounds = {n for f in graph.filters().values() for n in graph.filter_segment(f)[1]}
    out = {}
    for node in graph.nodes.values():
        if not isinstance(node, Forward) or node.output != "logprobs" or node.name in in_rounds:
            continue
        (key,) = node.writes
        train = readers.get(key, [])
        if len(train) != 1 or trains.get(node.model) != train or train[0] not in options:
            continue
        t = graph.nodes[train[0]]
        opts = options[t.name].options
        sequences = [k for k in t.reads if k in graph.sequence_keys()]
        if sequences == [node.reads[0]] and (opts.get("epochs"), opts.get("mini_batches")) == (1, 1):
            out[node.name] = t.name
    return out


def verify_plan(graph: Graph, plan: ExecutionPlan) -> None:
    """Invariants of whatever the plan holds so far; raises PlanError."""
    if plan.layout is not None:
        _verify_layout(graph, plan)
    if plan.nodes and plan.layout is None:
        raise PlanError("the plan has node plans but no placement ('layout'); make it with `flowrl plan`.")
    if plan.nodes:
        planned = [n.node for n in plan.nodes]
        if sorted(planned) != sorted(graph.nodes):
            raise PlanError(f"plan covers nodes {sorted(planned)} but the graph has {sorted(graph.nodes)}.")
        groups = {g.name for g in plan.layout.groups} if plan.layout else set()
        for n in plan.nodes:
            if not 1 <= n.micro_batch_size <= max(n.rows, 1):
                raise PlanError(
                    f"node '{n.node}': micro-batch size {n.micro_batch_size} is outside 1..{n.rows} (its rows "
                    "per step)."
                )
            if n.group is not None and n.group not in groups:
                raise PlanError(
                    f"node '{n.node}' runs on unknown device group '{n.group}' (groups: {', '.join(sorted(groups))})."
                )
    if plan.fused:
        allowed = fusable(graph, plan.options)
        for fwd, train in plan.fused.items():
            if allowed.get(fwd) != train:
                here = ", ".join(f"{f} -> {t}" for f, t in allowed.items()) or "none"
                raise PlanError(
                    f"the plan fuses node '{fwd}' into '{train}', but only a log-prob forward whose output that "
                    "model's one train node alone reads, taking one update per batch, can be computed in its train "
                    f"step (here: {here}). Re-run `flowrl plan`."
                )
    for est in plan.memory:
        if est.required_bytes > est.capacity_bytes:
            parts = "; ".join(f"{k}: {gib(v)}" for k, v in sorted(est.breakdown.items(), key=lambda kv: -kv[1]))
            hw = plan.target.cluster.hardware.name
            peak = next((k for k in est.breakdown if k.startswith("peak: ")), "")
            advice = (
                "Most of its peak is a sharded model gathered whole while it computes (and its gradients, "
                "accumulated over the micro-steps of a mini-batch), which a smaller train.micro_batch_size does "
                "not shrink (it adds micro-steps): use a larger cluster (more devices, so that the model can be "
                "split tensor- or pipeline-parallel), a smaller model, or a train.micro_batch_size that takes a "
                "rank's whole mini-batch in one micro-step."
                if _gathered_first(peak)
                else "Use a smaller model, fewer prompts_per_step/samples_per_prompt, a smaller "
                "train.micro_batch_size, or a larger cluster."
            )
            raise PlanError(
                f"the plan needs {gib(est.required_bytes)} per device of group '{est.group}' but a {hw} "
                f"device offers {gib(est.capacity_bytes)} "
                f"(short by {gib(est.required_bytes - est.capacity_bytes)}). Breakdown: {parts}. {advice}"
            )


def _gathered_first(peak: str) -> bool:
    """Whether a memory breakdown's peak (``peak: node N ...``, named by the planner's memory pass, the larger
    part first) is mostly a sharded model's gathered weights rather than activations."""
    gathered, acts = peak.find("gathered weights"), peak.find("activations")
    return gathered >= 0 and (acts < 0 or gathered < acts)


def _verify_layout(graph: Graph, plan: ExecutionPlan) -> None:
    """Every model placed once; parallel sizes fill their group and divide heads, layers and batch."""
    c, t = plan.layout, plan.target
    if sorted(m.model for m in c.models) != sorted(graph.models):
        raise PlanError(
            f"the plan places models {sorted(m.model for m in c.models)} but the graph declares {sorted(graph.models)}."
        )
    if sum(g.devices for g in c.groups) > t.cluster.devices:
        raise PlanError(
            f"the plan uses {sum(g.devices for g in c.groups)} devices; the cluster has {t.cluster.devices}."
        )
    taken: set[int] = set()
    for g in c.groups:  # devices [first, first + devices) of the cluster, no two groups sharing one
        span = set(range(g.first, g.first + g.devices))
        if g.first + g.devices > t.cluster.devices or span & taken:
            why = "past the end of" if g.first + g.devices > t.cluster.devices else "shared with another group of"
            raise PlanError(
                f"device group '{g.name}' takes devices {g.first}..{g.first + g.devices - 1}, {why} the cluster's "
                f"{t.cluster.devices} (layout.groups: each group has its own devices, counting from 0)."
            )
        taken |= span
    groups = {g.name: g for g in c.groups}
    mini_batch = t.workload.sequences // t.workload.mini_batches if t.workload else None
    for m in c.models:
        p, g = m.parallel, groups.get(m.group)
        if g is None:
            raise PlanError(
                f"model '{m.model}' is placed on unknown device group '{m.group}' (groups: {', '.join(groups)})."
            )
        if p.dp * p.tp * p.pp != g.devices:
            raise PlanError(
                f"model '{m.model}': dp {p.dp} x tp {p.tp} x pp {p.pp} != {g.devices} devices of group '{g.name}'."
            )
        spec = t.spec(m.model)
        if spec.heads % p.tp or spec.layers % p.pp:
            raise PlanError(
                f"model '{m.model}': tp {p.tp} must divide {spec.heads} heads and pp {p.pp} the {spec.layers} layers."
            )
        v = m.virtual_stages
        if (v > 1) != (m.schedule == "interleaved" and p.pp > 1) or spec.layers % (p.pp * v):
            raise PlanError(
                f"model '{m.model}': schedule '{m.schedule}' with virtual_stages {v} over pp {p.pp}: only the "
                f"interleaved schedule with pp > 1 takes virtual_stages above 1 (and needs them), and pp x "
                f"virtual_stages must divide the {spec.layers} layers."
            )
        if mini_batch is not None and (mini_batch % p.dp or not 1 <= m.micro_batch <= mini_batch // p.dp):
            raise PlanError(
                f"model '{m.model}': dp {p.dp} must divide the mini-batch of {mini_batch} sequences and "
                f"micro-batch {m.micro_batch} fit in a rank's share."
            )
    first = (generating_models(graph) or [None])[0]
    for gen in (c.generation, *c.generations):
        model = gen.model or first
        heads = t.spec(model).heads
        if gen.group not in groups or gen.tp * gen.replicas != groups[gen.group].devices or heads % gen.tp:
            raise PlanError(
                f"generation of '{model}': tp {gen.tp} x {gen.replicas} replicas must fill group '{gen.group}' and "
                f"tp must divide its {heads} heads."
            )
