"""Recovery without the user: a run that loses a worker process or a whole node restarts from its last
checkpoint by itself.

`run_recovering` runs a plan on its executor inside the executor's ``session`` (a cluster it connected to,
or the private Ray it started, stays up between attempts). When an attempt raises `WorkerLostError` (an
actor that died, a node that left: never an error of the run's code or config, which is not retried), the
executor has already torn the workers down; this module then

1. stops with the error when the run keeps no checkpoints (``checkpoint=false``) or has used its
   ``max_restarts`` (the message gives the resume command),
2. waits up to ``device_wait_s`` for the devices the plan needs (a replaced node), asking the executor
   (`Executor.devices`) every second,
3. with too few devices left: re-plans the same graph and config for what is left when the run allows it
   (``replan_on_loss``; the caller's ``replan``, checked by `replan_conflict`), else stops with a message
   saying what is missing and the resume command,
4. resumes the run in the same folder from its newest checkpoint (step 0 when it has none yet): the metrics
   rows after that checkpoint are dropped and done again, so metrics.jsonl holds every step once, and a
   ``{"kind": "restart", "step": S, "restart": {...}}`` record at the step S the run continues at.

Each restart is one line through ``emit`` (the progress output) and one record in `RunResult.restarts`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowrl.errors import PlanError, WorkerLostError

if TYPE_CHECKING:
    from flowrl.contract.plan import ExecutionPlan
    from flowrl.contract.predict import Predictor
    from flowrl.contract.protocols import Executor, RunResult
    from flowrl.graph.ir import Graph

#: Seconds between asking the executor how many devices it could place, while waiting for them.
DEVICE_POLL_S = 1.0

Replan = Callable[["ExecutionPlan", int], "ExecutionPlan"]


def run_recovering(
    ex: Executor,
    graph: Graph,
    plan: ExecutionPlan,
    out_dir: Path,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    resume: bool = False,
    predictor: Predictor | None = None,
    replan: Replan | None = None,
    resume_command: Callable[[ExecutionPlan], str] = lambda p: "flowrl run --resume DIR",
    emit: Callable[[str], None] = print,
) -> RunResult:
    """Run ``plan`` in ``out_dir`` on ``ex``, restarting from the last checkpoint after each lost worker
    or node (at most ``plan.config.max_restarts`` times). ``replan(plan, devices)``: the plan for fewer
    devices (used with ``replan_on_loss``). ``resume_command(plan)``: what a user types to continue."""
    restarts: list[dict[str, Any]] = []
    events: tuple[dict[str, Any], ...] = ()
    with ex.session():
        while True:
            try:
                result = ex.run(
                    graph, plan, out_dir, on_step=on_step, resume=resume, predictor=predictor, events=events
                )
            except WorkerLostError as lost:
                plan, record = _restart(ex, plan, out_dir, lost, len(restarts), replan, resume_command, emit)
                restarts.append(record)
                events, resume = (record,), True
                continue
            result.restarts = restarts
            return result


def _restart(
    ex: Executor,
    plan: ExecutionPlan,
    out_dir: Path,
    lost: WorkerLostError,
    done: int,
    replan: Replan | None,
    resume_command: Callable[[ExecutionPlan], str],
    emit: Callable[[str], None],
) -> tuple[ExecutionPlan, dict[str, Any]]:
    """After ``lost``: the plan to continue with and the restart's record, or the error that stops the run."""
    from flowrl.runtime.checkpoint import latest

    cfg = plan.config
    again = f"continue it with `{resume_command(plan)}`"
    if cfg.max_restarts == 0:
        raise lost
    if not cfg.checkpoint:
        raise WorkerLostError(
            f"{lost} The run does not restart by itself: it keeps no checkpoint (checkpoint=false).",
            **_who(lost),
        ) from None
    if done >= cfg.max_restarts:
        raise WorkerLostError(
            f"{lost} The run gave up after {done} restart(s) (--max-restarts {cfg.max_restarts}); once the "
            f"cluster is sound again, {again}.",
            **_who(lost),
        ) from None
    need = plan.target.cluster.devices
    have = _wait_for_devices(ex, plan, need, cfg.device_wait_s)
    replanned = False
    if have is not None and have < need:
        kind = "GPU" if not plan.target.cluster.on_cpu else "CPU"
        short = (
            f"the cluster has {have} {kind} device(s) of the {need} the plan needs after waiting "
            f"{cfg.device_wait_s:g} s (--device-wait)"
        )
        if not cfg.replan_on_loss or replan is None or have < 1:
            raise WorkerLostError(
                f"{lost} It cannot restart: {short}. Add the missing devices (a replacement node) and {again}, or "
                "let it re-plan for the devices left (--replan-on-loss).",
                **_who(lost),
            ) from None
        new = replan(plan, have)
        conflict = replan_conflict(plan, new)
        if conflict:
            raise PlanError(
                f"{lost} {short}; re-planned for {have} device(s), the checkpoint cannot continue under the new "
                f"plan: {conflict}. Add the missing devices and {again}."
            ) from None
        plan, replanned = new, True
    found = latest(out_dir)
    step = found[0] + 1 if found is not None else 0
    count = done + 1
    where = f"from the checkpoint after step {found[0]}" if found is not None else "from step 0 (no checkpoint yet)"
    when = f"in iteration {lost.iteration}" if lost.iteration is not None else "during setup"
    who = f"worker rank {lost.rank} (pid {lost.pid})" if lost.rank is not None else "a worker"
    line = f"flowrl: {who} was lost {when}; restart {count}/{cfg.max_restarts} {where}"
    if replanned:
        line += f", re-planned for the {have} device(s) left (plan {plan.id})"
    emit(line)
    record = {
        "kind": "restart",
        "step": step,
        "restart": {
            "count": count,
            "max": cfg.max_restarts,
            "rank": lost.rank,
            "pid": lost.pid,
            "group": lost.group,
            "iteration": lost.iteration,
            "checkpoint_step": found[0] if found is not None else None,
            "devices": have if have is not None else need,
            "plan": plan.id,
            "replanned": replanned,
            "reason": " ".join(str(lost).split())[:500],
        },
    }
    return plan, record


def _who(lost: WorkerLostError) -> dict[str, Any]:
    return {"rank": lost.rank, "pid": lost.pid, "group": lost.group, "iteration": lost.iteration, "task": lost.task}


def _wait_for_devices(ex: Executor, plan: ExecutionPlan, need: int, wait_s: float) -> int | None:
    """The devices ``ex`` could place for ``plan``, once it has ``need`` or ``wait_s`` has passed (None: it
    cannot tell)."""
    deadline = time.monotonic() + wait_s
    have = ex.devices(plan)
    while have is not None and have < need and time.monotonic() < deadline:
        time.sleep(DEVICE_POLL_S)
        have = ex.devices(plan)
    return have


def replan_conflict(old: ExecutionPlan, new: ExecutionPlan) -> str:
    """Why a checkpoint written under ``old`` cannot continue under ``new`` ("" when it can). Weights and
    optimizer states are saved whole (FSDP2 full state dicts), so data, tensor and pipeline parallel sizes
    may change; the rollout schedule may not: a checkpoint holds the rollouts and steps its schedule ran
    ahead."""
    if old.layout is None or new.layout is None:
        return "a plan without a layout"
    if old.layout.rollout != new.layout.rollout:
        return (
            f"the rollout policy changes ({old.layout.rollout.mode}, staleness {old.layout.rollout.staleness} -> "
            f"{new.layout.rollout.mode}, staleness {new.layout.rollout.staleness}): the checkpoint holds the rollouts "
            "of the old schedule"
        )
    old_models = {m.model for m in old.layout.models}
    new_models = {m.model for m in new.layout.models}
    if old_models != new_models:
        return f"the models placed change ({', '.join(sorted(old_models ^ new_models))})"
    return ""
