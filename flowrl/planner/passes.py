"""The passes every plan goes through. Each is a plain function ``(ctx, plan) -> plan``.

resolve     -> every function, loss, task, engine and node option a plan names exists and fits;
               the workload follows from the run config unless one was given
place       -> models on device groups: the one colocated layout of a one-device cluster,
               or the auto-tuner's best plan for a larger one (placement, parallel sizes,
               rollout policy, weight sync)
micro_batch -> per node: its rows per step and micro-batch (configured, or the layout's,
               halved until its activations fit)
memory      -> per device group: the bytes one device needs; verification refuses a plan
               that does not fit, with the breakdown
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.contract.capabilities import declared, rollout_conflict, supports
from flowrl.contract.hardware import HardwareSpec, is_cpu
from flowrl.contract.layout import (
    ClusterPlan,
    DeviceGroup,
    GenerationLayout,
    ModelLayout,
    Parallel,
    RolloutPolicy,
    WeightSync,
)
from flowrl.contract.plan import ClusterTarget, ExecutionPlan, MemoryEstimate, NodePlan
from flowrl.contract.reading import (  # noqa: F401 (re-exported: plan-reading helpers the passes share)
    episode_budget,
    fusable,
    generating_models,
    model_checkpoints,
    verify_plan,
)
from flowrl.contract.resolved import EngineNumerics, ModelRun, NodeOptions, OptimizerSpec, SamplingSpec
from flowrl.contract.workload import Fixed, Histogram, Lengths, WorkloadSpec, max_length
from flowrl.errors import ConfigError, GraphError, PlanError, did_you_mean
from flowrl.graph.ir import Compute, Filter, Forward, Generate, Graph, Reward, Train
from flowrl.planner import memory as mem
from flowrl.planner.constraints import Constraints
from flowrl.planner.modelspec import role_models
from flowrl.specs import (
    AGGREGATES,
    AUTO,
    AlgoConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    algo_problems,
    rollout_parts,
)

if TYPE_CHECKING:
    from flowrl.planner.autotune import TuneResult
    from flowrl.plugins.manager import Registry

TRAIN_OPTIONS = ("epochs", "mini_batches")
ALGO_FIELDS = frozenset(AlgoConfig.__struct_fields__)


@dataclass
class PlanContext:
    """What passes may consult besides the plan: the graph, plugins, by-products, options."""

    graph: Graph
    registry: Registry
    cache: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # budget_s, seed, cost_model


def _replace(plan: ExecutionPlan, **changes: Any) -> ExecutionPlan:
    return msgspec.structs.replace(plan, **changes)


# ------------------------------------------------------------------ resolve


def node_options(
    graph: Graph, name: str, algo: AlgoConfig, registry: Registry, configured: dict[str, Any] | None = None
) -> tuple[AlgoConfig, dict[str, Any]]:
    """A node's options: the graph's, with ``configured`` (the config's ``nodes.NAME``) over them.
    Those naming AlgoConfig fields override ``algo``; the rest must be keyword arguments of its
    function (train nodes: epochs, mini_batches)."""
    node = graph.nodes[name]
    given = {**node.options, **(configured or {})}
    overrides = {k: v for k, v in given.items() if k in ALGO_FIELDS}
    rest = {k: v for k, v in given.items() if k not in ALGO_FIELDS}
    fn = _function(registry, node)
    allowed = (*TRAIN_OPTIONS, *_keyword_arguments(fn)) if isinstance(node, Train) else _keyword_arguments(fn)
    bad = [k for k in rest if k not in allowed]
    fields = [k for k in bad if k in type(node).__struct_fields__ and k in (configured or {})]
    if fields:
        raise GraphError(
            f"node '{name}': {', '.join(fields)} {'is a field' if len(fields) == 1 else 'are fields'} of the "
            f"{node.kind} node in the graph (set in the graph file, where `flowrl show` reads it), not an option; "
            f"`--set nodes.{name}.OPTION` sets the keyword options of its function only. Change it in the graph, "
            "or give the graph's build() a config-driven value."
        )
    if bad:
        known = ", ".join(sorted([*allowed, *ALGO_FIELDS]))
        configs = [f"nodes.{name}.{k}" for k in bad if k in (configured or {})]
        by = f" (set by the config: {', '.join(configs)})" if configs else ""
        raise GraphError(f"node '{name}': unknown option(s) {', '.join(bad)}{by}; allowed: {known}.")
    _check_option_types(name, fn, rest)
    try:
        algo = msgspec.convert({**msgspec.to_builtins(algo), **overrides}, AlgoConfig)
    except msgspec.ValidationError as exc:
        raise GraphError(f"node '{name}': bad option: {exc}") from None
    for key, why in algo_problems(algo):
        if key in overrides:
            where = f"nodes.{name}.{key}" if key in (configured or {}) else f"option '{key}'"
            raise GraphError(f"node '{name}': {where} = {overrides[key]!r} {why}.")
    for key in TRAIN_OPTIONS:
        if key in rest and (isinstance(rest[key], bool) or not isinstance(rest[key], int) or rest[key] < 1):
            raise GraphError(f"node '{name}': option '{key}' must be an integer >= 1, got {rest[key]!r}.")
    return algo, rest


def _function(registry: Registry, node: Any) -> Any:
    """The registered function a node calls: compute, reward and filter functions, an environment,
    a train node's loss (None for other kinds)."""
    if isinstance(node, Compute):
        return registry.get("compute_functions", node.fn)
    if isinstance(node, Reward):
        return registry.get("reward_functions", node.fn)
    if isinstance(node, Filter):
        return registry.get("filters", node.fn)
    if isinstance(node, Generate) and node.env is not None:
        return registry.get("environments", node.env)
    if isinstance(node, Train):
        return registry.get("losses", node.loss)
    return None


def _check_option_types(node: str, fn: Any, options: dict[str, Any]) -> None:
    """Each option against the annotation of the function's keyword argument, when it has one."""
    if fn is None or not options:
        return
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: nothing to check against
        return
    for key, value in options.items():
        if key in hints:
            try:
                msgspec.convert(value, hints[key])
            except (msgspec.ValidationError, TypeError) as exc:
                raise GraphError(f"node '{node}': option '{key}' = {value!r} does not fit its type ({exc}).") from None


def _keyword_arguments(fn: Any) -> tuple[str, ...]:
    if fn is None:
        return ()
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in keyword and (p.kind == p.KEYWORD_ONLY or p.default is not p.empty))


def resolve(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Check every task, function, loss, engine and node option the plan names.

    Fills the response budget from the task and, unless one was given, the workload from the config."""
    from flowrl.tasks.builtin import task_for

    reg, graph, cfg = ctx.registry, ctx.graph, plan.config
    task = task_for(cfg, registry={e.name: e.obj for e in reg.entries("tasks")})
    budget = cfg.rollout.max_new_tokens if cfg.rollout.max_new_tokens is not None else task.max_new_tokens()
    cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, max_new_tokens=budget))
    if cfg.algo.loss_norm is None:  # Dr. GRPO's constant (seq-mean-token-sum-norm): the response budget
        cfg = msgspec.structs.replace(cfg, algo=msgspec.structs.replace(cfg.algo, loss_norm=budget))
    rows = node_rows(graph, cfg.rollout.prompts_per_step)
    seqs = graph.sequence_keys()
    resolved: dict[str, NodeOptions] = {}
    for node in graph.nodes.values():
        if isinstance(node, Reward):
            reg.entry("reward_functions", node.fn)
        elif isinstance(node, Compute):
            entry = reg.entry("compute_functions", node.fn)
            _check_keys(node, f"compute function '{node.fn}'", entry.meta, seqs, node.updates)
        elif isinstance(node, Filter):
            entry = reg.entry("filters", node.fn)
            _check_keys(node, f"filter function '{node.fn}'", _inputs_only(entry.meta), seqs)
        elif isinstance(node, Generate) and node.env is not None:
            reg.entry("environments", node.env)
        elif isinstance(node, Train):
            entry = reg.entry("losses", node.loss)
            _check_keys(node, f"loss '{node.loss}'", _inputs_only(entry.meta), seqs)
            _check_unused(node, f"loss '{node.loss}'", entry.meta, seqs)
            decl = graph.models[node.model]
            want = "values" if decl.scalar_head else "logprobs"
            if entry.meta.get("output", "logprobs") != want:
                raise PlanError(
                    f"node '{node.name}': loss '{node.loss}' trains on {entry.meta.get('output')}, but model "
                    f"'{decl.name}' (role {decl.role}) produces {want}."
                )
            if entry.meta.get("aggregate", "token-mean") not in AGGREGATES:
                raise PlanError(
                    f"node '{node.name}': loss '{node.loss}' is registered with aggregate="
                    f"{entry.meta.get('aggregate')!r}; valid: {', '.join(AGGREGATES)} (what the loss is a mean over)."
                )
        resolved[node.name] = node_plan_options(graph, node.name, cfg, reg)
        if isinstance(node, Train):
            mini_batches = resolved[node.name].options["mini_batches"]
            where = (
                "the node's mini_batches option"
                if "mini_batches" in {**node.options, **cfg.nodes.get(node.name, {})}
                else "train.mini_batches"
            )
            if mini_batches > rows[node.name]:
                raise PlanError(
                    f"node '{node.name}': {mini_batches} mini-batches but only {rows[node.name]} rows per "
                    f"step; lower {where}."
                )
    for kind, name, field_ in (
        ("executors", cfg.executor, "executor"),
        ("generation_engines", cfg.generation.engine, "generation.engine"),
        ("training_engines", cfg.train.engine, "train.engine"),
    ):
        if name != AUTO:  # an 'auto' generation engine is chosen by `place`
            reg.entry(kind, name, field=field_)
    target = plan.target
    if target.models:  # per-role models: every graph model's own shape, the first actor's as the base
        models = role_models(target.models, {m: d.role for m, d in graph.models.items()})
        first = next(m for m, d in graph.models.items() if d.role == "actor") if graph.models else None
        target = msgspec.structs.replace(target, models=models, model=models.get(first or "", target.model))
    if target.workload is None:
        prompt_length, lengths = task_lengths(task, cfg.rollout.max_new_tokens, cfg.rollout.ignore_eos)
        turns = max((n.turns for n in graph.nodes.values() if isinstance(n, Generate) and n.env), default=1)
        if turns > 1:
            lengths = episode_lengths(graph, lengths, budget, cfg.rollout.ignore_eos)
        workload = WorkloadSpec(
            turns=turns,
            prompts_per_step=cfg.rollout.prompts_per_step,
            samples_per_prompt=cfg.rollout.samples_per_prompt,
            prompt_length=prompt_length,
            response_length=lengths,
            ppo_epochs=cfg.train.epochs,
            mini_batches=min(cfg.train.mini_batches, cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt),
        )
        target = msgspec.structs.replace(target, workload=workload)
    largest = max([target.spec(m).parameters() for m in graph.models] or [target.model.parameters()])
    numerics = resolve_numerics(cfg.train, target.cluster.hardware, largest)
    if target.capabilities is not None:  # a plan for an executor: its memory as the engine computes
        target = msgspec.structs.replace(target, numerics=engine_memory(target.numerics, numerics))
    runs = model_runs(graph, cfg, budget, numerics)
    fused = fused_forwards(graph, resolved, reg, cfg.train.engine)
    return _replace(plan, config=cfg, target=target, options=resolved, models=runs, fused=fused)


def fused_forwards(graph: Graph, options: dict[str, NodeOptions], registry: Registry, engine: str) -> dict[str, str]:
    """Forward nodes whose output their model's train node computes itself (forward -> train node).

    A policy that takes one optimizer step per batch (one epoch, one mini-batch) trains on the very
    weights that computed its old log-probs, so they are its own log-probs, detached (TRL's
    ``num_iterations=1``): the train step computes them in its forward and the forward pass is
    saved. Only where the training engine ``engine`` declares it can (`EngineCapabilities.own_outputs`)
    and the loss trains on log-probs; the structure `fusable` checks besides."""
    if not declared(registry, "training_engines", engine).own_outputs:
        return {}
    return {
        fwd: train
        for fwd, train in fusable(graph, options).items()
        if registry.entry("losses", graph.nodes[train].loss).meta.get("output", "logprobs") == "logprobs"
    }


#: Parameters from which a CPU with native bfloat16 (avx512_bf16 / AMX) trains faster in bfloat16: measured
#: here (fwd+bwd of 16 x 112 tokens): 4.8 M parameters 2.2x, 25 M 2.4x, SmolLM2-135M
#: 2.0x faster. Below it stay the tiny models the toy tasks train from scratch: exact, and overhead-bound.
CPU_BF16_PARAMETERS = 10_000_000


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this machine's CPU computes bfloat16 natively (avx512_bf16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_numerics(train: TrainConfig, hw: HardwareSpec, parameters: int = 0) -> EngineNumerics:
    """How the training engine computes: ``train.dtype`` / ``train.attention``, ``auto`` taking bfloat16
    and SDPA on a GPU; on a CPU eager attention (faster than SDPA here, padded batches included) and
    float32, or bfloat16 for a model of ``CPU_BF16_PARAMETERS`` or more on a CPU with native bfloat16
    (``parameters``: the largest graph model's); flash attention is refused on a CPU."""
    cpu = is_cpu(hw)
    if cpu and train.attention == "flash_attention_2":
        raise ConfigError(
            f"train.attention=flash_attention_2 needs a CUDA GPU (with the flash-attn package); the plan's device "
            f"is a CPU ('{hw.name}'). Use train.attention=sdpa or eager."
        )
    half = not cpu or (parameters >= CPU_BF16_PARAMETERS and cpu_has_bf16())
    dtype = train.dtype if train.dtype != AUTO else ("bfloat16" if half else "float32")
    attention = train.attention if train.attention != AUTO else ("eager" if cpu else "sdpa")
    return EngineNumerics(dtype=dtype, attention=attention, recompute=train.recompute)


def engine_memory(base: mem.Numerics, numerics: EngineNumerics) -> mem.Numerics:
    """The executor's memory numerics (``base``: float32 master weights, gradients and AdamW states) for
    an engine computing as ``numerics``: bfloat16 computes with a bfloat16 copy of the float32 weights
    (2 bytes a parameter while the model computes: autocast's casts, FSDP2's gathered parameters) and
    keeps 2-byte activations; recomputation keeps only each layer's input; eager attention keeps the
    heads x sequence scores. Checked against what runs by benchmarks/memory_fidelity.py."""
    half = numerics.dtype == "bfloat16"
    return msgspec.structs.replace(
        base,
        compute_copy_bytes=2 if half and base.weight_bytes >= 4 else 0,
        activation_bytes=2 if half else max(base.activation_bytes, 4),
        recompute=numerics.recompute,
        eager_attention=numerics.attention == "eager",
    )


def node_plan_options(graph: Graph, name: str, cfg: RunConfig, registry: Registry) -> NodeOptions:
    """A node's resolved options (the graph's, with the config's ``nodes.NAME`` over them); a train
    node's epochs and mini-batches default to the config's."""
    algo, options = node_options(graph, name, cfg.algo, registry, configured_options(graph, cfg, name))
    if isinstance(graph.nodes[name], Train):
        options = {"epochs": cfg.train.epochs, "mini_batches": cfg.train.mini_batches, **options}
    return NodeOptions(algo=algo, options=options)


def configured_options(graph: Graph, cfg: RunConfig, name: str) -> dict[str, Any]:
    """The options the config sets for node ``name`` (``nodes: {NAME: {OPTION: VALUE}}``, ``--set
    nodes.NAME.OPTION=VALUE``); a node the graph does not have is refused, naming the graph's nodes."""
    for given in cfg.nodes:
        if given not in graph.nodes:
            raise ConfigError(
                f"config field 'nodes.{given}': graph '{graph.name}' has no node '{given}'."
                f"{did_you_mean(given, list(graph.nodes))} Its nodes: {', '.join(graph.nodes)}."
            )
    return cfg.nodes.get(name, {})


def model_runs(
    graph: Graph, cfg: RunConfig, budget: int, numerics: EngineNumerics | None = None
) -> dict[str, ModelRun]:
    """What each graph model's engines run: where its weights come from, how it samples (and takes
    log-probs), its optimizer when trainable; ``budget``: the response budget. The generation engine
    and its tp are `place`'s."""
    generating = set(generating_models(graph))
    checkpoints = model_checkpoints(graph, cfg.model)
    roll, train = cfg.rollout, cfg.train
    sampling = SamplingSpec(
        temperature=roll.temperature,
        top_p=roll.top_p,
        max_new_tokens=budget,
        ignore_eos=roll.ignore_eos,
        stop=tuple(roll.stop),
        dtype=cfg.generation.dtype,
    )
    runs = {}
    for name, decl in graph.models.items():
        optimizer = None
        if decl.trainable:
            lr = train.critic_lr if decl.scalar_head and train.critic_lr else train.lr
            optimizer = OptimizerSpec(
                lr=lr,
                betas=train.betas,
                weight_decay=train.weight_decay,
                grad_clip=train.grad_clip,
                skip_nonfinite=train.skip_nonfinite,
            )
        budget_of = episode_budget(graph, name, budget)
        runs[name] = ModelRun(
            model=name,
            checkpoint=checkpoints[name],
            tiny=cfg.tiny_model,
            seed=cfg.seed,
            training_engine=train.engine,
            generation_engine=cfg.generation.engine if name in generating else None,
            sampling=sampling if budget_of == budget else msgspec.structs.replace(sampling, max_new_tokens=budget_of),
            optimizer=optimizer,
            numerics=numerics or EngineNumerics(),
            max_tokens_per_micro_batch=train.max_tokens_per_micro_batch,
            pack=train.pack,
            lora=train.lora if decl.trainable and train.lora.rank > 0 else None,
        )
    return runs


def _with_generation(plan: ExecutionPlan, engine: str) -> ExecutionPlan:
    """``plan`` with its generating models' runs set to ``engine`` and their layout's tp."""
    if plan.layout is None:
        return plan
    runs = dict(plan.models)
    for name, run in plan.models.items():
        if run.generation_engine is not None:
            tp = plan.layout.generation_of(name).tp
            sampling = msgspec.structs.replace(run.sampling, tp=tp)
            runs[name] = msgspec.structs.replace(run, generation_engine=engine, sampling=sampling)
    return _replace(plan, models=runs)


def task_lengths(task: Any, budget: int, ignore_eos: bool) -> tuple[int, Lengths]:
    """The prompt length (tokens, with BOS) and response lengths a policy that solves ``task``
    produces: its answers plus EOS, capped at the budget, as a histogram over 2000 drawn prompts
    (the budget itself when EOS is ignored)."""
    import random
    from collections import Counter

    if hasattr(task, "prompt_tokens"):  # a dataset: its prompts' token counts; responses as long as allowed
        return task.prompt_tokens(), Fixed(value=budget)
    drawn = task.prompts(random.Random(0), 2000)
    prompt = max(len(p.text) for p in drawn) + 1
    if ignore_eos:
        return prompt, Fixed(value=budget)
    counts = Counter(min(len(p.answer) + 1, budget) for p in drawn)
    return prompt, Histogram(lengths=sorted(counts), weights=[float(counts[k]) for k in sorted(counts)])


def episode_lengths(graph: Graph, answer: Lengths, budget: int, ignore_eos: bool) -> Lengths:
    """The response lengths of a graph's multi-turn episodes: each of its ``turns`` model turns about
    an answer long (at most ``turn_tokens``) and, between turns, environment text about as long again
    (at most ``env_tokens`` in all), within the episode's budget; the whole budget when EOS is ignored."""
    node = max((n for n in graph.nodes.values() if isinstance(n, Generate) and n.env), key=lambda n: n.turns)
    cap = episode_budget(graph, node.model, budget)
    if ignore_eos:
        return Fixed(value=cap)
    values, weights = (
        (answer.lengths, answer.weights) if isinstance(answer, Histogram) else ([max_length(answer)], [1.0])
    )
    out: dict[int, float] = {}
    for length, weight in zip(values, weights):
        turn = min(length, node.turn_tokens or length)
        env = min((node.turns - 1) * length, node.env_tokens if node.env_tokens is not None else cap)
        total = min(node.turns * turn + env, cap)
        out[total] = out.get(total, 0.0) + weight
    return Histogram(lengths=sorted(out), weights=[out[k] for k in sorted(out)])


def _inputs_only(meta: dict[str, Any]) -> dict[str, Any]:
    """A loss's or filter's ports: inputs only (what it gives is not keys)."""
    return {"needs": meta.get("needs", ()), "optional": meta.get("optional", ())}


def _check_keys(
    node: Any, what: str, meta: dict[str, Any], sequence_keys: set[str], state: tuple[str, ...] = ()
) -> None:
    """The node's port bindings against what its function declares: every input port it needs is
    bound to a key the node reads; every key it writes comes from a port the function gives."""
    needs, gives = tuple(meta.get("needs", ())), meta.get("gives")
    for port in needs:
        key = node.ports.get(port, port)
        if key not in node.reads:
            bound = f"port '{port}' is bound to key '{key}'" if port in node.ports else f"key '{key}'"
            bind = "" if port in node.ports else f", or bind the port to a key it reads (ports={{{port!r}: KEY}})"
            raise PlanError(
                f"node '{node.name}': {what} needs {bound}, but the node does not read it. Add '{key}' to its "
                f"reads{bind}."
            )
    port_of = {key: port for port, key in node.ports.items()}
    if gives is not None:
        for key in node.writes:
            port = port_of.get(key, key)
            if port not in gives:
                via = f" (through port '{port}')" if key in port_of else ""
                raise PlanError(
                    f"node '{node.name}' writes key '{key}'{via}, but {what} only produces {', '.join(gives)}; bind "
                    f"one of them to it (ports={{'{gives[0] if gives else 'PORT'}': '{key}'}})."
                )
    if needs or gives:  # the function declares its ports: a binding of another port is a mistake
        known = set(needs) | set(gives or ()) | set(meta.get("optional", ())) | set(state)
        for port, key in node.ports.items():
            if port not in known and key not in sequence_keys:  # responses are found by their type
                raise PlanError(
                    f"node '{node.name}': port '{port}' (bound to key '{key}') is not a port of {what}; its ports: "
                    f"{', '.join(sorted(known)) or 'none'}."
                )


def _check_unused(node: Any, what: str, meta: dict[str, Any], sequence_keys: set[str]) -> None:
    """A node whose function declares its ports reads no key the function does not use: such a read
    only makes the producer run for nothing (a reference forward whose log-probs no loss reads)."""
    declared = set(meta.get("needs", ())) | set(meta.get("optional", ()))
    if not declared:
        return
    port_of = {key: port for port, key in node.ports.items()}
    unused = [k for k in node.reads if k not in sequence_keys and port_of.get(k, k) not in declared]
    if unused:
        raise PlanError(
            f"node '{node.name}' reads {', '.join(repr(k) for k in unused)}, which {what} does not use (it reads "
            f"{', '.join(sorted(declared))}); computing it would be wasted work. Drop it from the node's reads "
            "(and the node that produces it, if nothing else reads it), or use a loss that reads it."
        )


# ------------------------------------------------------------------ place


def plan_rows(ctx: PlanContext, plan: ExecutionPlan) -> dict[str, int]:
    """The rows each node of ``plan`` sees per step: the workload's prompts and samples, each
    generate node's own samples where the graph did not take them from the config, the groups a
    filter passes, and one row per prompt after a compute function that reduces to prompts."""
    reduced = {}
    for node in ctx.graph.nodes.values():
        if isinstance(node, Compute) and node.fn in ctx.registry.names("compute_functions"):
            port = ctx.registry.entry("compute_functions", node.fn).meta.get("rows")
            if port is not None:
                reduced[node.name] = node.ports.get(port, port)
    w = plan.workload
    return node_rows(
        ctx.graph, w.prompts_per_step, w.samples_per_prompt, plan.config.rollout.samples_per_prompt, reduced
    )


def node_rows(
    graph: Graph,
    prompts: int,
    samples: int | None = None,
    built: int | None = None,
    reduced: dict[str, str] | None = None,
) -> dict[str, int]:
    """Sequences each node sees per step, propagated along keys from the graph inputs; a
    sampling generate node multiplies by its ``n`` (or by ``samples``, a workload's, where its
    ``n`` is the ``built`` one: the config's samples_per_prompt the graph was built with); a
    filter with ``groups`` passes that many groups to the nodes after it; a ``reduced`` node
    writes as many rows as the key it is mapped to."""
    key_rows = {key: prompts for key in graph.inputs}
    out: dict[str, int] = {}
    for name in graph.order():
        node = graph.nodes[name]
        rows = max((key_rows.get(k, prompts) for k in node.reads), default=prompts)
        if reduced and name in reduced:  # its outputs have the rows of one key it reads (e.g. one per prompt)
            rows = key_rows.get(reduced[name], rows)
        if isinstance(node, Generate):
            n = samples if samples and (built is None or node.n == built) else node.n
            rows = rows * (1 if node.greedy else n)
        out[name] = rows
        for key in node.writes:
            key_rows[key] = rows
        if isinstance(node, Filter) and node.groups is not None:  # the nodes after it see its groups
            gen, between = graph.filter_segment(name)
            asked = key_rows.get(graph.nodes[gen].reads[0], prompts)
            for inner in (gen, *between):
                for key in graph.nodes[inner].writes:
                    key_rows[key] = max(key_rows[key] * node.groups // max(asked, 1), 1)
            key_rows[graph.nodes[gen].reads[0]] = node.groups
    return out


def colocated(graph: Graph, workload: WorkloadSpec, micro_batch: int | None = None) -> ClusterPlan:
    """The one layout of a one-device cluster: every model on it, generation in place."""
    mini_batch = max(workload.sequences // workload.mini_batches, 1)
    mini_batch = min(micro_batch or mini_batch, mini_batch)
    return ClusterPlan(
        placement="colocate",
        groups=(DeviceGroup(name="all", devices=1, first=0),),
        models=tuple(
            ModelLayout(model=m, group="all", parallel=Parallel(dp=1, tp=1, pp=1), micro_batch=mini_batch)
            for m in graph.models
        ),
        generation=GenerationLayout(group="all", tp=1, replicas=1),
        rollout=RolloutPolicy(),
        weight_sync=WeightSync(strategy="reshard"),
        generations=tuple(
            GenerationLayout(group="all", tp=1, replicas=1, model=m) for m in generating_models(graph)[1:]
        ),
    )


def rollout_policy(rollout: RolloutConfig) -> RolloutPolicy | None:
    """The policy ``rollout.mode`` asks for (None: the tuner chooses)."""
    if rollout.mode is None:
        return None
    start, flags = rollout_parts(rollout.mode)
    partial = "partial" in flags
    eta = rollout.staleness
    if eta is None:  # the mode's own: on-policy when sync, else one version, and one more when partial
        eta = (start != "sync") + partial
    if partial and eta < 1:
        raise PlanError(
            "rollout.mode has 'partial': unfinished responses continue under the next weights, so their oldest "
            "tokens are one version old; set rollout.staleness >= 1 (or leave it unset)."
        )
    return RolloutPolicy(
        mode=start,  # type: ignore[arg-type]
        staleness=eta,
        partial=partial,
        overprovision=rollout.overprovision if partial else 0.0,
        streaming="streaming" in flags,
        chunk_tokens=rollout.chunk_tokens,
    )


def generation_engines(ctx: PlanContext, plan: ExecutionPlan) -> list[str]:
    """The generation engines a plan may use: the configured one, or for ``auto`` the training
    engine's own (it samples in float32) and every registered engine that `flowrl profile`
    calibrated on this hardware and that runs the model's head size there."""
    cfg = plan.config
    if cfg.generation.engine != AUTO:
        return [cfg.generation.engine]
    hw, head = plan.target.cluster.hardware, plan.target.spec(generating_models(ctx.graph)[0]).dim_per_head
    names = [
        name
        for name in ctx.registry.names("generation_engines")
        if name != cfg.train.engine
        and name in hw.generation
        and (not hw.generation[name].head_sizes or head in hw.generation[name].head_sizes)
    ]
    if cfg.generation.dtype == "float32":
        names.insert(0, cfg.train.engine)
    if not names:
        raise PlanError(
            f"generation.dtype={cfg.generation.dtype} needs a generation engine other than the training engine "
            f"'{cfg.train.engine}', and none is calibrated on '{hw.name}' for this model; name one with "
            "--set generation.engine=NAME (e.g. vllm), or run `flowrl profile` with it installed."
        )
    return names


def place(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Place models on device groups (for a backend's one device: the colocated layout; else: the
    tuner's best), and choose the generation engine when it is ``auto``: the one whose best plan
    the simulator predicts fastest (``ctx.cache["engines"]``: each candidate's step time)."""
    rollout = any(isinstance(n, Generate) for n in ctx.graph.nodes.values())
    engines = generation_engines(ctx, plan) if rollout else [plan.config.train.engine]
    tried = {name: _place(ctx, plan, name, share=len(engines)) for name in engines}
    chosen = engines[0]
    if len(engines) > 1:
        predicted = {name: result.ranked[0].result.iteration_s for name, (_, result) in tried.items()}
        chosen = min(engines, key=lambda name: predicted[name])
        ctx.cache["engines"] = predicted
    placed, result = tried[chosen]
    if result is not None:
        ctx.cache["tune"] = result
    cfg = placed.config
    if cfg.generation.engine != chosen:
        placed = _replace(placed, config=msgspec.structs.replace(cfg, generation=msgspec.structs.replace(
            cfg.generation, engine=chosen)))  # fmt: skip
    return _with_generation(placed, chosen)


def _place(
    ctx: PlanContext, plan: ExecutionPlan, engine: str, share: int = 1
) -> tuple[ExecutionPlan, TuneResult | None]:
    """`place` with generation costed as ``engine`` generates; ``share``: candidates splitting the search
    budget. Returns the placed plan and the tuner's ranking (None: no rollout, nothing simulated).

    A plan for a backend on one device is the colocated layout with each model's micro-batch the
    mini-batch, halved until it fits; it is still simulated, so --explain shows its prediction.
    Otherwise the auto-tuner searches the cluster (within the backend's capabilities, if any)."""
    t, opts = plan.target, ctx.options
    rollout = any(isinstance(n, Generate) for n in ctx.graph.nodes.values())
    single = None
    caps = t.capabilities
    in_place = caps is not None and supports(caps, "colocate", RolloutPolicy(), WeightSync(strategy="reshard"), 1)
    if t.cluster.devices == 1 and (in_place or not rollout):
        single = _fit_micro_batches(
            ctx.graph, plan, colocated(ctx.graph, plan.workload, plan.config.train.micro_batch_size)
        )
        if not rollout:
            return _replace(plan, layout=single), None  # nothing to simulate
    elif not rollout:
        raise PlanError(f"graph '{ctx.graph.name}' has no generate node; the cluster planner needs a rollout.")
    tuner = plan_tuner(ctx, plan, engine)
    pins = {k: opts.get(k) for k in ("placement", "weight_sync")}
    if single is not None and any(pins.values()):
        raise PlanError("--placement / --sync choose among cluster plans; this plan is for one device.")
    require = opts.get("require")
    for key, flag, field_ in (("placement", "--placement", "placement"), ("weight_sync", "--sync", "sync")):
        wanted = getattr(require, key, None) if require else None
        if pins[key] and wanted and pins[key] != wanted:
            raise PlanError(f"{flag} {pins[key]} contradicts --require {field_}={wanted}; keep one.")
    if single is not None and require:
        raise PlanError("--require chooses among a cluster's plans; this plan is for one device (add --cluster).")
    free_policy = rollout_policy(plan.config.rollout)
    policy = free_policy
    if require and require.rollout_mode:
        policy = rollout_policy(msgspec.structs.replace(plan.config.rollout, mode=require.rollout_mode))
    if single is not None and policy is not None:
        conflict = rollout_conflict(ctx.graph, policy)
        if conflict:
            raise PlanError(conflict)
        single = msgspec.structs.replace(single, rollout=policy)
    budget = float(opts.get("budget_s", 8.0)) / share
    chunk = plan.config.rollout.chunk_tokens
    if single is not None:
        result = tuner.single(single)
    else:
        result = tuner.search(budget_s=budget, rollout=policy, chunk_tokens=chunk, **pins)
    if require and opts.get("compare"):  # the unconstrained winner, for --explain to set beside it
        tuner.constraints = Constraints()
        tuner._layout_cache.clear()
        free = tuner.search(budget_s=budget, rollout=free_policy, chunk_tokens=chunk, **pins)
        if result.ranked[0].result.iteration_s < free.ranked[0].result.iteration_s:
            free = result  # the constrained winner is in the unconstrained space: a shorter search missed it
        ctx.cache["unconstrained"] = free
    return _replace(plan, layout=result.best), result


def plan_tuner(ctx: PlanContext, plan: ExecutionPlan, engine: str, target: ClusterTarget | None = None) -> Any:
    """The tuner that costs ``plan``'s candidates (``target``: another cluster, model or workload), with
    generation costed as ``engine`` generates."""
    from flowrl.planner.autotune import Tuner

    t, opts = target or plan.target, ctx.options
    return Tuner(
        ctx.graph,
        t.model,
        t.cluster,
        t.workload or plan.workload,
        seed=int(opts.get("seed", 0)),
        cost_model=opts.get("cost_model", "analytic"),
        registry=ctx.registry,
        numerics=t.numerics,
        capabilities=t.capabilities,
        generation_engine=engine,
        training_engine=plan.config.train.engine,
        rows=plan_rows(ctx, plan),
        train_steps=_own_train_steps(ctx.graph, plan),
        fused=plan.fused,
        constraints=opts.get("require"),
        models=t.models or None,
        micro_batch=plan.config.train.micro_batch_size,
        unsplit=[m for m, run in plan.models.items() if run.lora is not None],  # the torch engine splits no adapters
    )


def replay(graph: Graph, plan: ExecutionPlan, registry: Registry, target: ClusterTarget | None = None) -> Any:
    """The simulator's prediction (a ``SimResult``) of ``plan``'s layout as it was placed, on ``target``
    (default: the plan's own: its hardware, model and workload)."""
    from flowrl.planner.autotune import FINAL

    if plan.layout is None:
        raise PlanError(f"plan {plan.id or '?'} has no layout to simulate (it was not placed).")
    ctx = PlanContext(graph=graph, registry=registry)
    tuner = plan_tuner(ctx, plan, plan.config.generation.engine, target)
    return tuner.evaluate(plan.layout, **FINAL).result


def _own_train_steps(graph: Graph, plan: ExecutionPlan) -> dict[str, tuple[int, int]]:
    """Train nodes whose own options (graph or ``nodes.*``) set epochs or mini-batches: their
    (epochs, mini-batches), the workload's where the node sets only one."""
    out = {}
    for name in plan.options:
        own = {**graph.nodes[name].options, **plan.config.nodes.get(name, {})}
        if graph.nodes[name].trains and ("epochs" in own or "mini_batches" in own):
            w = plan.workload
            out[name] = (int(own.get("epochs", w.ppo_epochs)), int(own.get("mini_batches", w.mini_batches)))
    return out


# ------------------------------------------------------------------ micro_batch


def _seq_len(plan: ExecutionPlan) -> int:
    return plan.workload.max_sequence()


def micro_batch(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """Set each node's rows per step and micro-batch: configured, or its model layout's."""
    cfg, layout = plan.config, _layout(plan)
    nodes = []
    for name, rows in plan_rows(ctx, plan).items():
        node = ctx.graph.nodes[name]
        group = None
        size = rows
        if isinstance(node, Generate):
            group = layout.generation_of(node.model).group
        elif node.model is not None:
            lay = layout.layout(node.model)
            group = lay.group
            if isinstance(node, (Forward, Train)):
                size = min(cfg.train.micro_batch_size or lay.micro_batch, rows)
                if isinstance(node, Train):  # a micro-batch never spans two mini-batches
                    size = min(size, max(rows // _mini_batches(plan, node), 1))
        nodes.append(NodePlan(node=name, kind=node.kind, group=group, rows=rows, micro_batch_size=max(size, 1)))
    return _replace(plan, nodes=tuple(nodes))


def _mini_batches(plan: ExecutionPlan, node: Train) -> int:
    """A train node's mini-batches per step, as resolved (the graph's, the config's)."""
    resolved = plan.options.get(node.name)
    if resolved is not None:
        return int(resolved.options["mini_batches"])
    return int(node.options.get("mini_batches", plan.config.train.mini_batches))


def _layout(plan: ExecutionPlan) -> ClusterPlan:
    if plan.layout is None:
        raise PlanError("the plan has no placement yet; run the 'place' pass first.")
    return plan.layout


def _fit_micro_batches(graph: Graph, plan: ExecutionPlan, layout: ClusterPlan) -> ClusterPlan:
    """Halve each model's micro-batch (unless configured) until its activations take at most half
    the headroom its device has left after the resident model states."""
    if plan.config.train.micro_batch_size is not None:
        return layout
    t, seq_len, trainable = plan.target, _seq_len(plan), _trainable(graph)
    capacity = mem.usable_bytes(t.cluster.hardware, t.numerics)
    rooms = {
        g.name: max(capacity - sum(_group_states(graph, plan, layout, g.name).values()), 0) // 2 for g in layout.groups
    }
    models = []
    for lay in layout.models:
        room = rooms[lay.group]
        size = lay.micro_batch
        while size > 1 and _pass_bytes(plan, lay, size, seq_len, lay.model in trainable) > room:
            size = (size + 1) // 2
        models.append(msgspec.structs.replace(lay, micro_batch=size))
    return msgspec.structs.replace(layout, models=tuple(models))


def _group_states(graph: Graph, plan: ExecutionPlan, layout: ClusterPlan, group: str) -> dict[str, int]:
    """The resident model states on one device of ``group``, by model."""
    t, trainable = plan.target, _trainable(graph)

    def trained(model: str) -> int | None:  # LoRA: the adapters' parameters train, the rest is held
        lora = plan.models[model].lora if model in plan.models else None
        return None if lora is None else t.spec(model).lora_parameters(lora.rank, lora.target_modules)

    out = {}
    for m in layout.models:
        if m.group != group:
            continue
        base_of = lora_base(graph, plan, layout, m.model)
        if base_of is not None:  # held once, in its LoRA model's weights
            out[f"model {m.model} (the base of {base_of}'s LoRA: its weights)"] = 0
            continue
        kind = "weights+grads+optimizer" if m.model in trainable else "weights"
        out[f"model {m.model} ({kind})"] = mem.state_bytes(
            t.spec(m.model), t.numerics, m, m.model in trainable, trained(m.model)
        )
    return out


def budgeted_rows(rows: int, seq_len: int, max_tokens: int | None) -> int:
    """The rows of a micro-batch of ``rows`` under a token budget (``train.max_tokens_per_micro_batch``):
    as many rows of ``seq_len`` tokens as the budget holds, at least one (a longer row is computed alone)."""
    return rows if max_tokens is None else max(1, min(rows, max_tokens // max(seq_len, 1)))


def _generates_in_place(plan: ExecutionPlan, layout: ClusterPlan, model: str | None, group: str) -> bool:
    """Whether ``model`` samples on ``group`` with the weights its training engine holds there (the
    training engine generating, colocated, on one device): no second copy of its weights."""
    run = plan.models.get(model or "")
    if not plan.target.numerics.generation_in_place or run is None or run.generation_engine != run.training_engine:
        return False
    # a model sharded over several devices samples with a replica per generation replica (as `lower` runs it),
    # unless its tp ranks are the generation layout's
    return layout.generation_of(model or "").group == group and layout.trains_as_it_generates(model or "")


def _resident_replica(plan: ExecutionPlan, layout: ClusterPlan, model: str | None) -> bool:
    """Whether ``model`` generates with a replica an engine that otherwise samples in place (the torch
    engine: `Numerics.generation_in_place`) builds beside its sharded training engine and keeps."""
    run = plan.models.get(model or "")
    trained = next((m for m in layout.models if m.model == model), None)
    return (
        plan.target.numerics.generation_in_place
        and run is not None
        and trained is not None
        and run.generation_engine == run.training_engine
        and trained.group == layout.generation_of(model or "").group
    )


def lora_base(graph: Graph, plan: ExecutionPlan, layout: ClusterPlan, model: str) -> str | None:
    """The LoRA-trained model whose base ``model`` is -- a frozen LM initialised from it, from the same
    folder, both on one device of one group -- and so holds no weights of its own (the torch engine
    runs it as that model with its adapters switched off); None otherwise."""
    decl = graph.models.get(model)
    if decl is None or decl.trainable or decl.scalar_head or decl.init_from is None:
        return None
    run, source = plan.models.get(model), plan.models.get(decl.init_from)
    if run is None or source is None or source.lora is None or run.checkpoint != source.checkpoint:
        return None
    mine, theirs = layout.layout(model), layout.layout(decl.init_from)
    alone = all(lay.parallel.dp * lay.parallel.tp * lay.parallel.pp == 1 for lay in (mine, theirs))
    return decl.init_from if alone and mine.group == theirs.group else None


def _trainable(graph: Graph) -> set[str]:
    return {m for m, d in graph.models.items() if d.trainable}


def _pass_bytes(plan: ExecutionPlan, lay: ModelLayout, size: int, seq_len: int, trainable: bool) -> int:
    """`memory.model_pass_bytes` of ``lay`` with micro-batches of ``size`` rows."""
    t = plan.target
    return mem.model_pass_bytes(
        t.spec(lay.model), t.numerics, msgspec.structs.replace(lay, micro_batch=size), seq_len, trainable
    )


# ------------------------------------------------------------------ memory


def memory(ctx: PlanContext, plan: ExecutionPlan) -> ExecutionPlan:
    """The bytes one device of each group needs: resident states plus the largest transient."""
    t, layout = plan.target, _layout(plan)
    seq_len = _seq_len(plan)
    estimates = []
    for g in layout.groups:
        states = _group_states(ctx.graph, plan, layout, g.name)
        peaks: dict[str, int] = {}
        for n in plan.nodes:
            if n.group != g.name:
                continue
            if n.kind == "generate":
                model = ctx.graph.nodes[n.node].model
                in_place = _generates_in_place(plan, layout, model, g.name)
                resident = not in_place and _resident_replica(plan, layout, model)
                gen = layout.generation_of(model or "")
                if resident:  # the torch engine's own replica, built once and kept: a state of the group
                    states[f"model {model} (its generation replica's weights)"] = int(
                        t.spec(model).parameters() * t.numerics.weight_bytes / gen.tp
                    )
                what = "its compute copy" if in_place or resident else "generation weights"
                peaks[f"node {n.node} ({what} + KV cache)"] = mem.generation_bytes(
                    t.spec(model), t.numerics, gen, n.rows, seq_len, in_place or resident
                )
                trained = next((m for m in layout.models if m.model == model), None)
                if resident and trained is not None and mem.sharded(t.numerics, trained, True):
                    # the sync gathers the sharded weights whole on every rank before they load
                    peaks[f"weight sync of {model} (its gathered weights)"] = int(
                        t.spec(model).parameters() * t.numerics.weight_bytes
                    )
            elif n.kind in ("forward", "train"):
                node = ctx.graph.nodes[n.node]
                model = node.model
                lay = layout.layout(model)
                training = n.kind == "train"
                budget = plan.models[model].max_tokens_per_micro_batch
                size = budgeted_rows(n.micro_batch_size, seq_len, budget)
                name = f"node {n.node} activations" + (" (+ its compute copy)" if t.numerics.compute_copy_bytes else "")
                steps = mem.micro_steps(n.rows, lay, size, _mini_batches(plan, node) if training else 1, budget is None)
                peaks[name] = mem.pass_bytes(
                    t.spec(lay.model), t.numerics, msgspec.structs.replace(lay, micro_batch=size), seq_len,
                    training=training, trainable=model in _trainable(ctx.graph), micro_steps=steps,
                )  # fmt: skip
        need, breakdown = mem.group_need(states, peaks)
        estimates.append(
            MemoryEstimate(
                group=g.name,
                capacity_bytes=mem.usable_bytes(t.cluster.hardware, t.numerics),
                required_bytes=need,
                breakdown=breakdown,
            )
        )
    return _replace(plan, memory=tuple(estimates))


PIPELINE = ("resolve", "place", "micro_batch", "memory")
BUILTIN_PASSES = {"resolve": resolve, "place": place, "micro_batch": micro_batch, "memory": memory}
