"""Run traces: every task the driver ran (on which groups, when) and every span each worker
recorded, merged into one Chrome trace (``trace.json``, which Perfetto and chrome://tracing
open) and drawn as ``timeline.png`` beside the predicted timeline of the run's `Predictor` (the
planner's, handed in by whoever started the run)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowrl.contract.predict import Forecast, steady

if TYPE_CHECKING:
    from flowrl.contract.plan import ExecutionPlan
    from flowrl.contract.predict import Predictor
    from flowrl.graph.ir import Graph
    from flowrl.runtime.schedule import Schedule


@dataclass
class Trace:
    origin: float  # wall-clock seconds all times are relative to
    tasks: list[tuple[str, tuple[str, ...], float, float, int]] = field(default_factory=list)  # name, rows, s, e, it
    workers: list[tuple[int, str, float, float]] = field(default_factory=list)  # rank, tag, start, end
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, task: str, rows: tuple[str, ...], start: float, end: float, iteration: int) -> None:
        with self._lock:
            self.tasks.append((task, rows, start - self.origin, end - self.origin, iteration))

    def add_workers(self, spans: dict[int, list[tuple[str, float, float]]]) -> None:
        with self._lock:
            for rank, items in spans.items():
                for tag, s, e in items:
                    self.workers.append((rank, tag or "call", s - self.origin, e - self.origin))

    # ------------------------------------------------------------ output
    def chrome(self, schedule: Schedule) -> dict[str, Any]:
        """Chrome trace events: one process per worker rank (named by its groups) plus the driver."""
        events: list[dict[str, Any]] = []
        names = {r: [g.name for g in schedule.groups if r in g.ranks] for r in range(schedule.world)}
        for rank, groups in names.items():
            label = f"rank {rank} ({', '.join(groups) or 'idle'})"
            events.append({"ph": "M", "name": "process_name", "pid": rank + 1, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "driver"}})
        for rank, tag, s, e in self.workers:
            events.append(_span(tag, rank + 1, 0, s, e, {}))
        rows = sorted({r for _, rs, *_ in self.tasks for r in rs})
        for name, rs, s, e, it in self.tasks:
            for r in rs:
                events.append(_span(name, 0, rows.index(r), s, e, {"iteration": it, "group": r}))
        for i, r in enumerate(rows):
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": r}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(
        self, out_dir: Path, plan: ExecutionPlan, graph: Graph, schedule: Schedule, predictor: Predictor | None = None
    ) -> None:
        (out_dir / "trace.json").write_text(json.dumps(self.chrome(schedule)))
        draw_measured_vs_predicted(self, plan, graph, out_dir / "timeline.png", predictor)


def _span(name: str, pid: int, tid: int, start: float, end: float, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": round(start * 1e6, 1),
        "dur": round(max(end - start, 0.0) * 1e6, 1),
        "args": args,
    }


def draw_measured_vs_predicted(
    trace: Trace, plan: ExecutionPlan, graph: Graph, path: Path, predictor: Predictor | None = None
) -> None:
    """Two timelines on one time axis each: what ran (per device group) and what ``predictor`` predicted
    (without one, the measured timeline alone)."""
    from flowrl.runtime.trackers import cache_dir, default_env

    default_env("MPLCONFIGDIR", cache_dir(path.parent, "matplotlib"))  # its font cache: in the run folder
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        forecast = predictor.predict(graph, plan) if predictor is not None else Forecast()
    except Exception:  # a plan the simulator cannot replay still gets its measured timeline
        forecast = Forecast()
    predicted, pred_iter = forecast.spans, forecast.iteration_s
    rows = [g.name for g in plan.layout.groups] + ["controller"] if plan.layout else ["controller"]
    names = sorted({_legend(t[0]) for t in trace.tasks + predicted})
    cmap = plt.get_cmap("tab20")
    colors = {n: cmap(i % 20) for i, n in enumerate(names)}
    shown = steady_window(trace.tasks, len({t[4] for t in predicted}) or SHOWN_ITERATIONS)
    panels = [("measured", shown)] + ([("predicted", predicted)] if predicted else [])
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(12, 1.2 + 1.1 * len(rows) * len(panels)), squeeze=False, sharex=True
    )
    start = min((t[2] for t in shown), default=0.0)
    measured_iter = _iteration_seconds(trace.tasks)
    hardware = plan.target.cluster.hardware
    calibrated = "calibrated" if hardware.calibration is not None else "uncalibrated: `flowrl calibrate` this run"
    iterations = sorted({t[4] for t in shown})
    for ax, (label, spans) in zip(axes[:, 0], panels):
        t0 = start if label == "measured" else 0.0
        for name, groups, s, e, _it in spans:
            key = _legend(name)
            for g in groups:
                if g not in rows:
                    continue
                ax.barh(rows.index(g), e - s, left=s - t0, color=colors.get(key, "grey"), edgecolor="white", lw=0.4)
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        if label == "measured":
            which = f"iterations {iterations[0]}-{iterations[-1]}" if iterations else "no iterations"
            title = f"measured: {measured_iter:.3f} s/iteration (median; {which} of {_count(trace.tasks)} shown)"
        else:
            title = f"predicted ({calibrated}): {pred_iter:.3f} s/iteration"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    fig.legend(handles, names, fontsize=6, ncol=min(6, len(names)), loc="lower center")
    fig.suptitle(f"{graph.name}: {plan.layout.summary() if plan.layout else ''}", fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _legend(task: str) -> str:
    """One legend entry for weight syncs, measured (``sync:<train node>``) or predicted (``weight_sync``)."""
    return "weight sync" if task == "weight_sync" or task.startswith("sync:") else task


#: Measured iterations drawn when there is no prediction to match.
SHOWN_ITERATIONS = 4


def _count(tasks: list[tuple[str, tuple[str, ...], float, float, int]]) -> int:
    return len({t[4] for t in tasks})


def steady_window(
    tasks: list[tuple[str, tuple[str, ...], float, float, int]], count: int
) -> list[tuple[str, tuple[str, ...], float, float, int]]:
    """The tasks of ``count`` consecutive iterations from the middle of the run's steady state (past
    warm-up): the measured panel then spans as many iterations as the predicted one, on its time scale."""
    iterations = steady([t[4] for t in tasks]) or sorted({t[4] for t in tasks})
    if not iterations:
        return []
    middle = max(0, len(iterations) // 2 - count // 2)
    keep = set(iterations[middle : middle + count])
    return [t for t in tasks if t[4] in keep]


def _iteration_seconds(tasks: list[tuple[str, tuple[str, ...], float, float, int]]) -> float:
    """Median time from one iteration's first task start to its last task end."""
    by_it: dict[int, list[float]] = {}
    for _, _, s, e, it in tasks:
        lo_hi = by_it.setdefault(it, [s, e])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], s), max(lo_hi[1], e)
    spans = sorted(e - s for s, e in by_it.values())
    return spans[len(spans) // 2] if spans else 0.0
