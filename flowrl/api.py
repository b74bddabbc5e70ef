"""The Python entry points the CLI uses: load a graph, plan it for a cluster, run a plan.

Every plan is for a cluster; without one it is this machine as the run's executor describes
it (``local``: one device). Executors and engines come from the plugin registry by the names
the run config gives (``executor``, ``generation.engine``, ``train.engine``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from flowrl.contract.capabilities import Capabilities, of_config
from flowrl.contract.hardware import ClusterSpec, HardwareSpec
from flowrl.contract.model import ModelSpec, for_config
from flowrl.contract.plan import ClusterTarget, ExecutionPlan
from flowrl.contract.protocols import Executor, RunResult
from flowrl.errors import FlowRLError, PlanError, PluginError, reworded
from flowrl.graph.ir import Graph
from flowrl.graph.loading import build_graph, find_graph
from flowrl.planner.hardware import cpu_cluster, with_calibration
from flowrl.planner.manager import initial_plan, run_passes
from flowrl.planner.passes import PIPELINE, PassResults, PlanContext, PlanOptions, plan_options, with_candidate
from flowrl.planner.predict import Simulator
from flowrl.plugins.manager import Entry, Registry
from flowrl.plugins.manager import registry as default_registry
from flowrl.specs import RunConfig, build_config, nested, parse_override


def make_config(
    defaults: dict[str, Any],
    config_file: dict[str, Any] | None = None,
    overrides: Iterable[str] = (),
    flags: dict[str, Any] | None = None,
) -> RunConfig:
    """Defaults of the graph < config file < --set overrides < dedicated flags."""
    layers = [defaults, config_file or {}]
    layers += [nested(*parse_override(o)) for o in overrides]
    layers.append({k: v for k, v in (flags or {}).items() if v is not None})
    return build_config(*layers)


def _algorithms(reg: Registry) -> dict[str, Any]:
    return {e.name: e.obj for e in reg.entries("algorithms")}


def load(
    source: str,
    *,
    config_file: dict[str, Any] | None = None,
    overrides: Iterable[str] = (),
    flags: dict[str, Any] | None = None,
    registry: Registry | None = None,
) -> tuple[Graph, RunConfig]:
    reg = registry or default_registry()
    src = find_graph(source, _algorithms(reg), reg)
    cfg = make_config(src.defaults, config_file, overrides, flags)
    return build_graph(src, cfg), cfg


def response_budget(cfg: RunConfig, registry: Registry | None = None) -> int:
    """The run's response budget in tokens: ``rollout.max_new_tokens``, else its task's (for a
    graph's ``build(cfg)`` that sizes something by it, such as DAPO's overlong penalty)."""
    if cfg.rollout.max_new_tokens:
        return cfg.rollout.max_new_tokens
    from flowrl.tasks.builtin import task_for

    tasks = {e.name: e.obj for e in (registry or default_registry()).entries("tasks")}
    return int(task_for(cfg, registry=tasks).max_new_tokens())


def executor_entry(cfg: RunConfig, reg: Registry) -> Entry:
    return reg.entry("executors", cfg.executor, field="executor")


def model_spec(cfg: RunConfig) -> ModelSpec:
    """The base model's shape: the HF config of ``cfg.model`` (with per-model folders,
    ``actor=DIR,rm=DIR2``, the actor's or the default's: `flowrl.contract.model.base_folder`; every folder is
    checked), or the tiny model built from scratch."""
    from flowrl.tasks.tokenizer import vocab

    return for_config(cfg.model, cfg.tiny_model, len(vocab()))


def local_target(cfg: RunConfig, reg: Registry, devices: int = 1) -> ClusterTarget:
    """This machine as the run's executor sees it: one device, its memory and speed; with
    ``devices > 1`` its CPU cut into that many devices (``--cluster cpu:N``)."""
    entry = executor_entry(cfg, reg)
    machine = entry.meta.get("machine")
    if machine is None:
        raise PlanError(f"executor '{cfg.executor}' does not describe this machine; plan with --cluster.")
    caps: Capabilities = of_config(entry.obj.capabilities, reg, cfg)
    try:
        hardware = machine(cfg)
    except FlowRLError:
        raise
    except Exception as exc:
        where = f"executor '{cfg.executor}' (plugin '{entry.plugin}')"
        raise PluginError(f"{where}: machine(cfg) failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(hardware, HardwareSpec):
        where = f"executor '{cfg.executor}' (plugin '{entry.plugin}')"
        raise PluginError(f"{where}: machine(cfg) returned {hardware!r}, not a HardwareSpec.")
    cluster = with_calibration(
        ClusterSpec(nodes=1, devices_per_node=1, hardware=hardware) if devices == 1 else cpu_cluster(hardware, devices)
    )
    return ClusterTarget(cluster=cluster, model=model_spec(cfg), numerics=caps.numerics, capabilities=caps)


def plan(
    source: str,
    *,
    registry: Registry | None = None,
    passes: Iterable[str] | None = None,
    print_after: Iterable[str] = (),
    emit: Callable[[str], None] = print,
    target: ClusterTarget | None = None,
    options: PlanOptions | dict[str, Any] | None = None,
    results: PassResults | None = None,
    for_backend: bool = False,
    **kwargs: Any,
) -> tuple[Graph, ExecutionPlan]:
    """Compile a graph for ``target`` (a cluster, model and workload), by default this machine.

    Without a target the plan is for the config's executor on this machine. With one, it is a
    forecast for any backend unless ``for_backend``, which limits it to what the config's
    executor can run, with its memory numerics. ``options``: how to plan (`PlanOptions`, or a mapping of
    its fields: budget_s, seed, cost_model, placement, weight_sync, require, compare). ``results``
    receives the passes' typed by-products (``results.place.tune``: the ranked candidates)."""
    reg = registry or default_registry()
    graph, cfg = load(source, registry=reg, **kwargs)
    if target is None:
        target = local_target(cfg, reg)
    elif for_backend:
        caps = of_config(executor_entry(cfg, reg).obj.capabilities, reg, cfg)
        target = msgspec.structs.replace(target, numerics=caps.numerics, capabilities=caps)
    ctx = PlanContext(graph=graph, registry=reg, options=plan_options(options), results=results or PassResults())
    initial = initial_plan(graph, source, cfg, target)
    return graph, run_passes(
        graph, initial, reg, passes=PIPELINE if passes is None else passes, print_after=print_after, emit=emit, ctx=ctx
    )


def plan_ranked(
    source: str,
    *,
    top: int = 3,
    registry: Registry | None = None,
    emit: Callable[[str], None] = print,
    target: ClusterTarget | None = None,
    options: PlanOptions | dict[str, Any] | None = None,
    results: PassResults | None = None,
    for_backend: bool = False,
    shapes: bool = False,
    **kwargs: Any,
) -> tuple[Graph, list[ExecutionPlan]]:
    """`plan`, but one plan for each of the tuner's first ``top`` distinct candidates (distinct layout,
    rollout policy or weight sync; ``shapes``: distinct shapes, `ClusterPlan.shape`, the best of each), best
    first: each is the plan `plan` would return had that candidate won (its layout, the objective's record
    of its own prediction; the passes after ``place`` run on it). The first is `plan`'s own.
    ``results.place.tune`` receives the ranking; a graph without a rollout has one plan, and one device one
    candidate."""
    from flowrl.planner.autotune import distinct

    if top < 1:
        raise PlanError(f"plan_ranked: top is {top}; ask for at least one candidate.")
    reg = registry or default_registry()
    results = results or PassResults()
    split = PIPELINE.index("place") + 1
    graph, placed = plan(
        source, registry=reg, passes=PIPELINE[:split], emit=emit, target=target, options=options, results=results,
        for_backend=for_backend, **kwargs,
    )  # fmt: skip
    tune = results.place.tune if results.place is not None else None
    candidates = distinct(tune.ranked, top, shapes) if tune is not None else [None]  # no rollout: the one plan
    ctx = PlanContext(graph=graph, registry=reg, options=plan_options(options), results=results)
    return graph, [
        run_passes(
            graph,
            placed if c is None else with_candidate(placed, tune, c),
            reg,
            passes=PIPELINE[split:],
            emit=emit,
            ctx=ctx,
        )
        for c in candidates
    ]


def graph_for_plan(p: ExecutionPlan, registry: Registry | None = None, source: str | None = None) -> Graph:
    """Rebuild the graph a plan names (or the graph file ``source``), with the plan's config: a graph
    other than the planned one is refused (the executor checks the rest of the plan)."""
    reg = registry or default_registry()
    graph = build_graph(find_graph(source or p.graph.source, _algorithms(reg), reg), p.config)
    if graph.fingerprint() != p.graph.fingerprint:
        raise PlanError(
            f"the plan was made for graph '{p.graph.name}' {p.graph.fingerprint} ('{p.graph.source}'), but "
            f"'{source or p.graph.source}' builds '{graph.name}' {graph.fingerprint()}. Re-run `flowrl plan`."
        )
    return graph


def executor(p: ExecutionPlan, registry: Registry | None = None) -> Executor:
    reg = registry or default_registry()
    return executor_entry(p.config, reg).obj(reg)


def check(graph: Graph, p: ExecutionPlan, registry: Registry | None = None) -> Executor:
    """The plan's executor, after it has checked that it can run the plan (nothing is built)."""
    ex = executor(p, registry)
    ex.check(graph, p)
    return ex


def replan(graph: Graph, p: ExecutionPlan, devices: int, registry: Registry | None = None) -> ExecutionPlan:
    """``p`` planned again for ``devices`` devices of its kind (what a cluster has left after it lost a
    node): the same graph and config, for the same executor; ``cpu:N`` becomes this machine as ``devices``
    CPU devices, a cluster of several nodes (GPUs, or a joined cluster's CPUs) keeps its hardware with fewer
    nodes (or one node of ``devices``)."""
    reg = registry or default_registry()
    cfg = p.config
    old = p.target.cluster
    nodes, per_node = (devices // old.devices_per_node, old.devices_per_node)
    if nodes < 1 or devices % old.devices_per_node:
        nodes, per_node = 1, devices
    if old.on_cpu:  # this machine's CPUs, or a joined cluster's CPU nodes: fewer nodes of the same size
        target = local_target(cfg, reg, devices)
        if old.nodes > 1 and per_node == old.devices_per_node:
            target = msgspec.structs.replace(target, cluster=msgspec.structs.replace(old, nodes=nodes))
    else:
        cluster = msgspec.structs.replace(old, nodes=nodes, devices_per_node=per_node)
        caps = of_config(executor_entry(cfg, reg).obj.capabilities, reg, cfg)
        target = msgspec.structs.replace(
            p.target, cluster=cluster, workload=None, numerics=caps.numerics, capabilities=caps
        )
    ctx = PlanContext(graph=graph, registry=reg, options=plan_options({"budget_s": 2.0}), results=PassResults())
    initial = initial_plan(graph, p.graph.source, cfg, target)
    new = run_passes(graph, initial, reg, passes=p.passes or PIPELINE, emit=lambda _: None, ctx=ctx)
    check(graph, new, reg)
    return new


def resume_command(p: ExecutionPlan, out: Path, address: str | None = None) -> str:
    """The command that continues the run of ``p`` in folder ``out``; ``address``: the Ray cluster the run
    joined (``--address``), which the resumed run must join again (without it, it would start a private Ray
    on this machine)."""
    source = p.graph.source
    graph_file = f"{source} " if source.endswith(".py") or "/" in source else ""
    joined = f" --address {address}" if address else ""
    return f"flowrl run {graph_file}--resume {out}{joined}"


def run(
    graph: Graph,
    p: ExecutionPlan,
    *,
    registry: Registry | None = None,
    out_dir: Path | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    executor: Executor | None = None,
    resume: bool = False,
    emit: Callable[[str], None] | None = None,
) -> RunResult:
    """Run ``p`` on its executor: ``executor`` when it has already checked the plan (``check``), else
    the one ``check`` returns, before the run folder is made. With ``resume``, ``out_dir`` is an
    earlier run's folder, continued from its newest checkpoint.

    A worker or node lost mid-run restarts the run from its last checkpoint, at most
    ``max_restarts`` times (`flowrl.runtime.recovery`; with ``replan_on_loss``, re-planned for the
    devices left); each restart is a line through ``emit`` (default: stderr).

    A run that fails before its first step completes leaves no folder behind; one that fails
    later keeps its folder, and the error says how to continue from its last checkpoint."""
    import shutil
    import sys

    from flowrl.runtime.checkpoint import latest
    from flowrl.runtime.executor import run_dir
    from flowrl.runtime.recovery import run_recovering

    reg = registry or default_registry()
    ex = executor or check(graph, p, reg)
    address = getattr(ex, "address", None)  # a joined Ray cluster (`--address`): a resume joins it again
    if resume and out_dir is None:
        raise PlanError("resume needs the run folder to continue (out_dir).")
    out = out_dir or run_dir(p.config.out, p.config.name or graph.name)
    before = latest(out) if resume else None
    # a folder this run makes or finds empty is removed when nothing completes; one holding files is kept
    fresh = out_dir is None or not out.exists() or (out.is_dir() and not any(out.iterdir()))
    try:
        return run_recovering(
            ex,
            graph,
            p,
            out,
            on_step=on_step,
            resume=resume,
            predictor=Simulator(reg),
            replan=lambda plan, devices: replan(graph, plan, devices, reg),
            resume_command=lambda plan: resume_command(plan, out, address),
            emit=emit or (lambda line: print(line, file=sys.stderr, flush=True)),
        )
    except BaseException as exc:
        metrics = out / "metrics.jsonl"
        now = latest(out)
        if not resume and fresh and (not metrics.is_file() or metrics.stat().st_size == 0):
            shutil.rmtree(out, ignore_errors=True)  # nothing completed: no half-made run folder
        elif isinstance(exc, FlowRLError) and now is not None and now != before and "--resume" not in str(exc):
            raise reworded(
                exc,
                f"{exc}\nThe run folder {out} keeps a checkpoint after step {now[0]}; continue it with "
                f"`{resume_command(p, out, address)}`.",
            ) from exc.__cause__
        raise
