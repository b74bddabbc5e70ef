"""What a run measured, read back for the planner: its plan, the steady-state time of each task
(from ``trace.json``, the spans every run writes) and of a whole iteration, and the response
lengths its rollouts produced (``metrics.jsonl``).

A run's first iterations warm up (allocation, the first compile of each shape), and the odd one
checkpoints or evaluates: the steady state is the median over the iterations after the first
``max(2, n // 10)``."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from flowrl.contract.plan import ExecutionPlan, load_plan
from flowrl.contract.predict import steady
from flowrl.errors import ConfigError

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


def _number(value: object) -> float | None:
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else None
    )


def _driver_spans(trace: object, where: str) -> list[tuple[str, int, float, float]]:
    """(task, iteration, start, end) of every task the driver ran, once per task (a task on several
    groups has one event per group). Chrome's bare-array format is read too; malformed events are skipped."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise ConfigError(f"{where}: 'traceEvents' is not a list of events; is it a trace a flowrl run wrote?")
    seen, out = set(), []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("pid") != 0:
            continue
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        it, ts, dur = args.get("iteration"), _number(e.get("ts")), _number(e.get("dur"))
        if (
            not isinstance(it, int)
            or isinstance(it, bool)
            or ts is None
            or dur is None
            or not isinstance(e.get("name"), str)
        ):
            continue
        key = (e["name"], it, ts)
        if key in seen:
            continue
        seen.add(key)
        out.append((e["name"], it, ts / 1e6, (ts + max(dur, 0.0)) / 1e6))
    if not out:
        raise ConfigError(
            f"{where} has no task spans of the driver (complete events of pid 0 with an iteration), as runs before "
            "flowrl recorded them do not; run the graph again to calibrate from it."
        )
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
    except RecursionError:
        raise ConfigError(f"{where}: trace.json is nested too deeply to be a trace.") from None
    spans = _driver_spans(trace, f"{where}: trace.json")
    records = read_records(folder / "metrics.jsonl")
    # an evaluation runs between two iterations (its record's step counts the updates before it): not their time
    evaluated = _eval_steps(records)
    keep = set(steady([it for _, it, _, _ in spans]))
    if len(keep) < 2:
        raise ConfigError(
            f"{where}: {len(set(it for _, it, _, _ in spans))} iterations traced; calibration needs at least 4 "
            "(2 of warm-up, then 2 to measure). Run more steps."
        )
    durations: dict[str, dict[int, float]] = {}
    ends: dict[int, float] = {}
    starts: dict[int, float] = {}
    sampling = {n.node for n in plan.nodes if n.kind == "generate"}
    for name, it, start, end in spans:
        if it not in keep:
            continue
        per_it = durations.setdefault(name, {})
        per_it[it] = per_it.get(it, 0.0) + (end - start)  # a task run in parts (streaming) sums its parts
        if name not in sampling:
            ends[it] = max(ends.get(it, 0.0), end)
            starts[it] = min(starts.get(it, math.inf), start)
    order = sorted(ends)
    # from one iteration's end to the next one's; across an evaluation, the iteration's own span
    gaps = [
        ends[b] - (ends[a] if not {a, b} & evaluated else starts[b]) for a, b in zip(order, order[1:]) if b == a + 1
    ]
    if not gaps:
        raise ConfigError(f"{where}: too few iterations with training-side tasks to measure an iteration.")
    if statistics.median(gaps) <= 0:
        raise ConfigError(
            f"{where}: trace.json's iterations take no time (every span at one instant); is it a real trace?"
        )
    lengths = _response_lengths(records, sampling, keep)
    return Measured(
        run=str(path),
        plan=plan,
        tasks={k: statistics.median(v.values()) for k, v in durations.items()},
        iteration_s=statistics.median(gaps),
        iterations=len(keep),
        response_length=lengths,
    )


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; lines that are not JSON objects (a crash's cut line, damage) are skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def _eval_steps(records: list[dict]) -> set[int]:
    """The steps after which the run evaluated (``kind: eval`` records)."""
    return {r["step"] for r in records if r.get("kind") == "eval" and isinstance(r.get("step"), int)}


def _response_lengths(records: list[dict], generators: set[str], keep: set[int]) -> dict[str, float]:
    """Mean ``<node>/response_length`` over the kept steps, per generate node (metrics.jsonl's records)."""
    sums: dict[str, list[float]] = {}
    for record in records:
        if record.get("kind") not in (None, "train") or record.get("step") not in keep:
            continue
        for node in generators:
            value = _number(record.get(f"{node}/response_length"))
            if value is not None and value > 0:
                sums.setdefault(node, []).append(value)
    return {node: statistics.fmean(v) for node, v in sums.items() if v}
