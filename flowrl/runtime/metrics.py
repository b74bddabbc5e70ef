"""A run's metrics: one line per step in ``metrics.jsonl`` (what each task reports, prefixed by its
name, the headline metrics, tokens and spans), extra records beside them (evaluations), the same
numbers sent to the run's experiment trackers (``--logger``, `flowrl.runtime.trackers`), and what
the run measured written back into its ``plan.yaml`` (a filter's acceptance rate, which the planner
costs dynamic sampling with)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import msgspec

from flowrl.contract.plan import ExecutionPlan, dump_plan

if TYPE_CHECKING:
    from flowrl.contract.protocols import RunResult
    from flowrl.graph.ir import Graph
    from flowrl.runtime.pipeline import StepState
    from flowrl.runtime.schedule import Schedule
    from flowrl.runtime.trace import Trace
    from flowrl.runtime.trackers import Trackers

#: Metrics also logged without the node prefix; the first task (in schedule order) that reports one wins.
HEADLINE = ("reward", "kl", "response_length", "sample", "logprob_gap")


class MetricsLog:
    """Writes each finished step's record to ``metrics.jsonl`` (appending when a run resumes) and the
    run's trackers, keeps it in the run's result and hands it to ``on_step``; collects the workers'
    spans into the trace. `log_extra` writes other records (evaluations) to the file and trackers."""

    def __init__(
        self,
        path: Path,
        schedule: Schedule,
        result: RunResult,
        trace: Trace,
        spans: Callable[[], Any],
        prompts_drawn: Callable[[], int],
        on_step: Callable[[dict[str, Any]], None] | None,
        append: bool,
        trackers: Trackers | None = None,
        reward_node: str | None = None,
    ) -> None:
        self.schedule, self.result, self.trace, self.spans = schedule, result, trace, spans
        self.reward_node = reward_node
        self.prompts_drawn, self.on_step, self.trackers = prompts_drawn, on_step, trackers
        if trackers and append and path.is_file():  # what the resumed run keeps (the file is cut to it)
            trackers.resumed([msgspec.json.decode(line) for line in path.read_text().splitlines() if line])
        self.fh: IO[str] = path.open("a" if append else "w")
        self.last = time.perf_counter()

    def step_done(self, step: int, state: StepState) -> None:
        record = step_record(self.schedule, step, state.outputs, time.perf_counter() - self.last, self.reward_node)
        record["prompts_drawn"] = self.prompts_drawn()
        self.last = time.perf_counter()
        self.trace.add_workers(self.spans())
        self._write(record, step)
        self.result.metrics.append(record)
        if self.on_step is not None:
            self.on_step(record)

    def log_extra(self, record: dict[str, Any]) -> None:
        """A record besides the steps' (``{"step": S, "kind": "eval", "eval/mean@4": ...}``): a line of
        metrics.jsonl, and its numbers to the trackers at its ``step``."""
        self._write(record, int(record["step"]))

    def _write(self, record: dict[str, Any], step: int) -> None:
        self.fh.write(msgspec.json.encode(record).decode() + "\n")
        self.fh.flush()
        if self.trackers:
            self.trackers.log(record, step)

    def sync(self) -> None:
        """On disk before a checkpoint names the steps it holds."""
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.fh.close()
        if self.trackers:
            self.trackers.close()


def step_record(
    schedule: Schedule,
    step: int,
    outputs: dict[str, tuple[float, dict[str, Any]]],
    seconds: float,
    reward_node: str | None = None,
) -> dict[str, Any]:
    """One step's metrics line: every task's metrics (prefixed by its name), the headline metrics,
    generated tokens and the step's wall-clock (since the step before it ended). The headline
    ``reward`` is ``reward_node``'s (the node writing the key ``rewards``: a weighted sum of several
    rewards, say) when it reports one, else the first node's that does."""
    record: dict[str, Any] = {"step": step}
    if reward_node is not None and isinstance(outputs.get(reward_node, (0, {}))[1].get("reward"), (int, float)):
        record["reward"] = outputs[reward_node][1]["reward"]
    spans: dict[str, float] = {}
    tokens, gen_seconds = 0, 0.0
    for task in schedule.tasks:  # metrics in schedule order, so headline metrics do not depend on timing
        took, metrics = outputs[task.name]
        spans[task.name] = round(took, 5)
        if task.kind == "generate":
            tokens += int(metrics["tokens"])
            gen_seconds += took
        for name in task.absorbs:  # nodes that ran inside the generate task (dynamic sampling)
            spans[name] = round(outputs[name][0], 5)
        for name in (task.name, *task.absorbs):
            for key, value in outputs[name][1].items():
                record[f"{name}/{key}"] = value
                if key in HEADLINE:
                    record.setdefault(key, value)
    record.setdefault("reward", None)
    record["tokens"] = tokens
    record["tokens_per_s"] = round(tokens / max(gen_seconds, 1e-9), 1)
    record["step_seconds"] = round(seconds, 5)
    record["spans"] = spans
    return record


def write_acceptance(graph: Graph, plan: ExecutionPlan, metrics: list[dict[str, Any]], path: Path) -> None:
    """A run of a graph with a filter measured its acceptance rate (the fraction of sampled groups
    the filter passed, over every step): it goes into the run's plan.yaml workload, where the
    planner reads it to cost dynamic sampling's extra generation (`flowrl plan --workload
    runs/NAME/plan.yaml`)."""
    workload = plan.target.workload
    keys = [f"{name}/acceptance" for name in graph.filters().values()]
    values = [m[k] for m in metrics for k in keys if isinstance(m.get(k), (int, float))]
    if workload is None or not values:
        return
    rate = min(max(sum(values) / len(values), 0.01), 1.0)
    target = msgspec.structs.replace(
        plan.target, workload=msgspec.structs.replace(workload, acceptance_rate=round(rate, 4))
    )
    dump_plan(msgspec.structs.replace(plan, target=target).sealed(), path)  # a new content id: the plan changed
