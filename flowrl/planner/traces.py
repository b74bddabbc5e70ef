"""What a run measured, read back for the planner: its plan, the steady-state time of each task
(from ``trace.json``, the spans every run writes) and of a whole iteration, and the response
lengths its rollouts produced (``metrics.jsonl``).

A run's first iterations warm up (allocation, the first compile of each shape), and the odd one
checkpoints or evaluates: the steady state is the median over the iterations after the first
``max(2, n // 10)``."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from flowrl.errors import ConfigError
from flowrl.planner.plan import ExecutionPlan, load_plan

#: What the run's trace calls a task the simulator names otherwise: a weight sync is ``sync:<train node>``.
SYNC_PREFIX = "sync:"


@dataclass(frozen=True)
class Measured:
    """One run's steady state."""

    run: str  # the run's folder, as given
    plan: ExecutionPlan
    tasks: dict[str, float]  # task -> median seconds per iteration
    iteration_s: float  # median time from one iteration's end to the next one's
    iterations: int  # how many iterations the medians are over
    response_length: dict[str, float]  # generate node -> mean response tokens over those iterations


def steady(iterations: list[int]) -> list[int]:
    """The iterations past warm-up, in order."""
    ordered = sorted(set(iterations))
    return ordered[max(2, len(ordered) // 10) :]


def _driver_spans(trace: dict, where: str) -> list[tuple[str, int, float, float]]:
    """(task, iteration, start, end) of every task the driver ran, once per task (a task on several
    groups has one event per group)."""
    seen, out = set(), []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("pid") != 0 or "iteration" not in (e.get("args") or {}):
            continue
        key = (e["name"], e["args"]["iteration"], e["ts"])
        if key in seen:
            continue
        seen.add(key)
        out.append((e["name"], int(e["args"]["iteration"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    if not out:
        raise ConfigError(f"{where} has no task spans of the driver (pid 0 events with an iteration).")
    return out


def read_run(path: str | Path) -> Measured:
    """The steady state of the run in folder ``path`` (its plan.yaml, trace.json and metrics.jsonl).
    Tasks keep the trace's names (a weight sync is ``sync:<train node>``)."""
    folder = Path(path)
    where = f"run '{path}'"
    if not folder.is_dir():
        raise ConfigError(f"{where}: no such folder; give the folder a run wrote (runs/NAME).")
    for name in ("plan.yaml", "trace.json"):
        if not (folder / name).is_file():
            raise ConfigError(
                f"{where}: no {name} (a run writes it when it finishes or stops); run it again, or give another folder."
            )
    plan = load_plan(folder / "plan.yaml")
    try:
        trace = json.loads((folder / "trace.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: trace.json cannot be read: {exc}.") from None
    spans = _driver_spans(trace, f"{where}'s trace.json")
    keep = set(steady([it for _, it, _, _ in spans]))
    if len(keep) < 2:
        raise ConfigError(
            f"{where}: {len(set(it for _, it, _, _ in spans))} iterations traced; calibration needs at least 4 "
            "(2 of warm-up, then 2 to measure). Run more steps."
        )
    durations: dict[str, dict[int, float]] = {}
    ends: dict[int, float] = {}
    sampling = {n.node for n in plan.nodes if n.kind == "generate"}
    for name, it, start, end in spans:
        if it not in keep:
            continue
        per_it = durations.setdefault(name, {})
        per_it[it] = per_it.get(it, 0.0) + (end - start)  # a task run in parts (streaming) sums its parts
        if name not in sampling:
            ends[it] = max(ends.get(it, 0.0), end)
    ordered = [ends[it] for it in sorted(ends)]
    gaps = [b - a for a, b in zip(ordered, ordered[1:])]
    if not gaps:
        raise ConfigError(f"{where}: too few iterations with training-side tasks to measure an iteration.")
    lengths = _response_lengths(folder / "metrics.jsonl", sampling, keep)
    return Measured(
        run=str(path),
        plan=plan,
        tasks={k: statistics.median(v.values()) for k, v in durations.items()},
        iteration_s=statistics.median(gaps),
        iterations=len(keep),
        response_length=lengths,
    )


def _response_lengths(path: Path, generators: set[str], keep: set[int]) -> dict[str, float]:
    """Mean ``<node>/response_length`` over the kept steps, per generate node (metrics.jsonl)."""
    if not path.is_file():
        return {}
    sums: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if record.get("kind") not in (None, "train") or record.get("step") not in keep:
            continue
        for node in generators:
            value = record.get(f"{node}/response_length")
            if isinstance(value, (int, float)):
                sums.setdefault(node, []).append(float(value))
    return {node: statistics.fmean(v) for node, v in sums.items() if v}
