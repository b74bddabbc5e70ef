"""`flowrl calibrate`: fit the cost model's factors to what runs measured.

Every run writes its plan (with the hardware it was costed on) and ``trace.json``. For each run
the simulator replays the plan's layout on the run's own response lengths (`traces.py`), and the
factors below are moved, by bounded least squares on log errors, until the predicted time of each
task and of the iteration match the measured steady state:

    residual(task) = sqrt(share of the iteration) * log(predicted / measured)   (every task both name)
    residual(iteration) = 2 * log(predicted / measured)

A factor is fitted only where some run measures it (moving it moves that run's predictions); the
others keep their values, and the result records which runs constrained which factor
(``HardwareSpec.calibration``). The fitted spec is saved per cluster (`hardware.calibration_path`),
and every later plan for that cluster (``local``, ``cpu:N``, a named cluster) is costed with it.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from flowrl.contract.hardware import Calibrated, HardwareSpec
from flowrl.contract.workload import Fixed, Histogram, LogNormal, WorkloadSpec, mean_length
from flowrl.errors import ConfigError, FlowRLError
from flowrl.graph.ir import Graph
from flowrl.planner.autotune import roles_of
from flowrl.planner.efficiency import curve_for
from flowrl.planner.hardware import cluster_key, get, with_values
from flowrl.planner.traces import SYNC_PREFIX, Measured, read_run


@dataclass(frozen=True)
class Factor:
    """One fitted number of a HardwareSpec: ``path`` (``kernel_overhead``, ``efficiency.e_max``,
    ``generation.vllm.kernel_overhead``), a typical magnitude (the unit it is fitted in where it is
    0 now) and its bounds."""

    path: str
    typical: float
    lo: float
    hi: float


#: The factors a calibration may fit (those a run measures), with a typical size and bounds.
FACTORS = (
    Factor("matmul_efficiency", 0.3, 1e-3, 1.0),
    Factor("efficiency.e_max", 0.6, 0.05, 1.0),
    Factor("kernel_overhead", 2e-5, 0.0, 0.1),
    Factor("task_overhead", 1e-3, 0.0, 10.0),
    Factor("decode_step_overhead", 1e-4, 0.0, 1.0),
    Factor("decode_row_overhead", 1e-6, 0.0, 0.01),
    Factor("generate_overhead", 1e-2, 0.0, 100.0),
    Factor("optimizer_tensor_overhead", 1e-4, 0.0, 1.0),
    Factor("controller_row_overhead", 2e-6, 0.0, 0.01),
    Factor("bandwidth_efficiency", 0.75, 1e-3, 1.0),
    Factor("tp_op_overhead", 3e-5, 0.0, 0.1),
    Factor("intra_node_latency", 5e-6, 0.0, 1.0),
    Factor("inter_node_latency", 1e-5, 0.0, 1.0),
    Factor("intra_node_bandwidth", 1e10, 1e6, 1e13),
    Factor("inter_node_bandwidth", 1e10, 1e6, 1e13),
    Factor("engine_tensor_overhead", 0.01, 0.0, 10.0),
    Factor("sync_tensor_overhead", 1e-3, 0.0, 10.0),
)
#: Per generation engine `flowrl profile` calibrated: ``generation.<engine>.<field>``.
ENGINE_FACTORS = (
    Factor("kernel_overhead", 2e-5, 0.0, 0.1),
    Factor("matmul_efficiency", 0.3, 1e-3, 1.0),
    Factor("load_bandwidth", 1e9, 1e5, 1e13),
)
#: A factor is measured by a run when tripling it (or setting it to its typical size) moves a residual this much.
SENSITIVE = 0.01
# A weak pull toward the current values, for factors the runs see only together: a factor something
# measured (a bandwidth, a latency, an efficiency) moves by its log, an overhead still at 0 by its size. Where
# the runs cannot tell two factors apart, the unmeasured overhead moves first.
PRIOR_LOG = 0.1
PRIOR_ZERO = 0.02


def candidates(hw: HardwareSpec, engines: set[str]) -> tuple[HardwareSpec, list[Factor]]:
    """The spec to fit (the GPU family's efficiency curve made its own, so that its ceiling can move)
    and the factors it has: the matmul constant where no curve applies, the curve's ceiling where one
    does; each used engine's calibration where `flowrl profile` made one."""
    curve = hw.efficiency or curve_for(hw)
    if curve is not None and hw.efficiency is None:
        hw = msgspec.structs.replace(hw, efficiency=curve)
    out = [f for f in FACTORS if f.path != ("matmul_efficiency" if curve is not None else "efficiency.e_max")]
    for engine in sorted(engines & set(hw.generation)):
        out += [Factor(f"generation.{engine}.{f.path}", f.typical, f.lo, f.hi) for f in ENGINE_FACTORS]
    return hw, out


# ------------------------------------------------------------------ one run, replayed


@dataclass(frozen=True)
class Replay:
    """A measured run and what the simulator needs to replay it with other factors."""

    measured: Measured
    graph: Graph
    workload: WorkloadSpec
    registry: Any
    whole: bool = True  # the iteration's time is fitted too (not for published phases alone)

    def predict(self, hw: HardwareSpec) -> Any:
        from flowrl.planner.passes import replay

        plan = self.measured.plan
        cluster = msgspec.structs.replace(plan.target.cluster, hardware=hw)
        target = msgspec.structs.replace(plan.target, cluster=cluster, workload=self.workload)
        return replay(self.graph, plan, self.registry, target)

    def residuals(self, hw: HardwareSpec) -> np.ndarray:
        result = self.predict(hw)
        m = self.measured
        out = [2.0 * math.log(max(result.iteration_s, 1e-12) / m.iteration_s)] if self.whole else []
        for task, seconds in sorted(m.tasks.items()):  # a task "a+b": the two together (a published phase)
            predicted = sum(result.breakdown.get(t, 0.0) for t in task.split("+"))
            if seconds > 0 and predicted > 0:
                share = max(seconds / m.iteration_s, 0.02)
                out.append(math.sqrt(share) * math.log(predicted / seconds))
        return np.asarray(out)


def scaled(dist: Any, mean: float, top: int) -> Any:
    """A length distribution of ``dist``'s shape with mean ``mean`` (what the run's responses averaged),
    at most ``top`` tokens (the response budget)."""
    now = mean_length(dist)
    if now <= 0 or mean <= 0 or abs(mean / now - 1) < 0.01:
        return dist
    ratio = mean / now
    if isinstance(dist, Fixed):
        return Fixed(value=min(top, max(1, round(mean))))
    if isinstance(dist, LogNormal):
        return msgspec.structs.replace(dist, median=dist.median * ratio)
    if isinstance(dist, Histogram):
        return Histogram(lengths=[min(top, max(1, round(n * ratio))) for n in dist.lengths], weights=list(dist.weights))
    return dist


def graph_of(measured: Measured, registry: Any, files: Sequence[str] = ()) -> Graph:
    """The graph a run ran. A graph *file* is code: it is built only when named in ``files``
    (``--graph``), or when it is a built-in algorithm's (``graphs/grpo.py`` is algorithm ``grpo``)."""
    plan = measured.plan
    source = plan.graph.source
    if not (source.endswith(".py") or "/" in source or "\\" in source):
        return _rebuilt(plan, registry, source)  # an algorithm by name
    builtin = [plan.graph.name] if plan.graph.name in registry.names("algorithms") else []
    failed = []
    for file in [*builtin, *files]:  # the built-in algorithm of that name, if it builds the graph the run ran
        if file in files and not Path(file).is_file():
            failed.append(f"--graph '{file}' does not exist")
            continue
        try:
            return _rebuilt(plan, registry, file)
        except FlowRLError as exc:
            if file in files:
                failed.append(f"--graph '{file}': {exc}")
    tried = f" ({'; '.join(failed)})" if failed else ""
    raise ConfigError(
        f"run '{measured.run}' ran the graph file '{source}', which is Python code and not a built-in "
        f"algorithm's; name it to rebuild the graph: `flowrl calibrate {measured.run} --graph {source}`{tried}."
    )


def _rebuilt(plan: Any, registry: Any, source: str) -> Graph:
    """The graph ``source`` builds with the plan's config; refused when it is not the graph the plan was made for."""
    from flowrl.graph.loading import build_graph, find_graph

    algorithms = {e.name: e.obj for e in registry.entries("algorithms")}
    graph = build_graph(find_graph(source, algorithms, registry), plan.config)
    if graph.fingerprint() != plan.graph.fingerprint:
        raise ConfigError(
            f"'{source}' builds graph '{graph.name}' {graph.fingerprint()}, not the run's '{plan.graph.name}' "
            f"{plan.graph.fingerprint}"
        )
    return graph


def replay_of(measured: Measured, registry: Any, files: Sequence[str] = ()) -> Replay:
    """The run's plan, graph and workload, with the response lengths its rollouts produced."""
    plan = measured.plan
    if plan.layout is None or (plan.target.workload is None and plan.layout.predicted is None):
        raise ConfigError(
            f"run '{measured.run}': its plan.yaml has no placed layout to replay; it cannot be calibrated."
        )
    graph = graph_of(measured, registry, files)
    workload = plan.target.workload or plan.workload
    lengths = list(measured.response_length.values())
    if lengths:
        workload = msgspec.structs.replace(
            workload,
            response_length=scaled(workload.response_length, float(np.mean(lengths)), _budget(plan, workload)),
        )
    syncs = sync_names(graph)
    tasks = {
        syncs.get(name[len(SYNC_PREFIX) :], "weight_sync") if name.startswith(SYNC_PREFIX) else name: seconds
        for name, seconds in measured.tasks.items()
    }
    measured = dataclasses.replace(measured, tasks=tasks)
    return Replay(measured=measured, graph=graph, workload=workload, registry=registry)


def _budget(plan: Any, workload: WorkloadSpec) -> int:
    """The most tokens a response may have: the run's budget (its max_new_tokens), else the workload's longest."""
    return max(workload.max_response(), int(getattr(plan.config.rollout, "max_new_tokens", 0) or 0))


def sync_names(graph: Graph) -> dict[str, str]:
    """Train node -> the simulator's name of the weight sync that follows it."""
    roles = roles_of(graph)
    return {
        n: ("weight_sync" if graph.nodes[n].model == roles.actor else f"weight_sync:{graph.nodes[n].model}")
        for n in graph.order()
        if graph.nodes[n].trains
    }


def read_runs(paths: Sequence[str], registry: Any, files: Sequence[str] = ()) -> list[Replay]:
    """Each run folder, read and made replayable; all of one cluster."""
    if not paths:
        raise ConfigError("flowrl calibrate needs at least one run folder (runs/NAME).")
    unique: dict[Path, str] = {}
    for path in paths:  # a folder named twice (runs/A and runs/A/) is one run
        unique.setdefault(Path(path).resolve(), str(path).rstrip("/\\") or str(path))
    replays = [replay_of(read_run(path), registry, files) for path in unique.values()]
    keys = {cluster_key(r.measured.plan.target.cluster) for r in replays}
    if len(keys) > 1:
        where = ", ".join(f"{r.measured.run} ({r.measured.plan.target.cluster.label})" for r in replays)
        raise ConfigError(f"these runs ran on different clusters ({where}); calibrate each cluster on its own.")
    return replays


# ------------------------------------------------------------------ the fit


@dataclass(frozen=True)
class Fit:
    hardware: HardwareSpec  # the fitted spec, with its provenance (``calibration``)
    before: dict[str, float]  # run -> predicted s/iteration before the fit
    after: dict[str, float]  # ... and after
    measured: dict[str, float]  # run -> measured s/iteration
    factors: dict[str, tuple[float, float, list[str]]]  # factor -> (before, after, the runs that measured it)


def fit_factors(
    replays: Sequence[Replay],
    bases: Sequence[HardwareSpec],
    factors: Sequence[Factor],
    *,
    progress: Callable[[str], None] = lambda s: None,
) -> tuple[dict[str, float], dict[str, list[str]]]:
    """The values of those ``factors`` some run measures, fitted to every run at once (each replayed on
    its own ``bases`` spec with the shared values), and the runs that measured each one."""
    from scipy.optimize import least_squares

    now = [r.residuals(b) for r, b in zip(replays, bases)]
    measured_by: dict[str, list[str]] = {}
    for f in factors:
        for r, b, r0 in zip(replays, bases, now):
            value = get(b, f.path)  # probed at 3x, or its typical size where an earlier fit left it near 0
            moved = with_values(b, {f.path: min(max(value * 3, f.typical), f.hi)})
            if np.max(np.abs(r.residuals(moved) - r0)) > SENSITIVE:
                measured_by.setdefault(f.path, []).append(r.measured.run)
    chosen = [f for f in factors if f.path in measured_by]
    if not chosen:
        raise ConfigError("these runs measure none of the cost model's factors (no task of theirs is costed).")
    progress(f"fitting {len(chosen)} factors to {len(replays)} runs: {', '.join(f.path for f in chosen)}")
    scale = np.array([get(bases[0], f.path) or f.typical for f in chosen])
    x0 = np.array([get(bases[0], f.path) for f in chosen]) / scale
    measured = x0 > 0

    def values(x: np.ndarray) -> dict[str, float]:
        return {f.path: float(v * s) for f, v, s in zip(chosen, x, scale)}

    def residuals(x: np.ndarray) -> np.ndarray:
        now = values(x)
        ratio = np.log(np.maximum(x, 1e-9) / np.where(measured, x0, 1.0))
        prior = np.where(measured, PRIOR_LOG * ratio, PRIOR_ZERO * x)
        return np.concatenate([*(r.residuals(with_values(b, now)) for r, b in zip(replays, bases)), prior])

    lo = np.array([f.lo for f in chosen]) / scale
    hi = np.array([f.hi for f in chosen]) / scale
    start = np.clip(np.where(measured, x0, 1.0), lo, hi)  # off the bound: a factor at 0 starts at its typical size
    solution = least_squares(residuals, start, bounds=(lo, hi), x_scale=1.0, diff_step=1e-3, max_nfev=200)
    return values(solution.x), {f.path: measured_by[f.path] for f in chosen}


def _cited(run: str, factors: dict[str, list[str]]) -> bool:
    return any(run in runs for runs in factors.values())


def fit(replays: Sequence[Replay], *, progress: Callable[[str], None] = lambda s: None) -> Fit:
    """Fit the factors the runs measure, starting from the hardware the first run was costed on."""
    base = replays[0].measured.plan.target.cluster.hardware
    earlier = base.calibration  # an earlier fit the runs were costed with: kept for the factors not refitted
    base = msgspec.structs.replace(base, calibration=None)
    engines = {r.measured.plan.config.generation.engine for r in replays}
    base, factors = candidates(base, engines)
    values, measured_by = fit_factors(replays, [base] * len(replays), factors, progress=progress)
    fitted = with_values(base, values)
    before = {r.measured.run: r.predict(base).iteration_s for r in replays}
    after = {r.measured.run: r.predict(fitted).iteration_s for r in replays}
    measured = {r.measured.run: r.measured.iteration_s for r in replays}
    kept = {k: v for k, v in (earlier.factors if earlier else {}).items() if k not in measured_by}
    runs = [r.measured.run for r in replays]
    provenance = Calibrated(
        runs=[*runs, *(run for run in (earlier.runs if earlier else []) if run not in runs and _cited(run, kept))],
        factors={**measured_by, **kept},
        when=datetime.date.today().isoformat(),
        fit={run: (round(before[run], 6), round(after[run], 6), round(measured[run], 6)) for run in measured},
    )
    table = {path: (get(base, path), get(fitted, path), runs) for path, runs in measured_by.items()}
    return Fit(
        hardware=msgspec.structs.replace(fitted, calibration=provenance),
        before=before,
        after=after,
        measured=measured,
        factors=table,
    )
