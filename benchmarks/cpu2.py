"""Shared by the benchmarks that run plans on this machine as ``cpu:2`` through Ray: the machine's
profile and one private Ray (`start`), the settings every run shares (`settings`), plans with pinned
layouts (`plan_variant`, `run_variant`), and what a run's metrics say (`reaching`, `seconds_to`, `summarise`)."""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

WINDOW = 5  # steps in the trailing mean of the reward that `seconds_to` compares with a target


def settings(steps: int, out: Path, name: str, *extra: str) -> list[str]:
    """The ``--set`` overrides of a benchmark run: ``steps`` steps from seed 0 on the Ray executor on CPU, no
    checkpoints or progress bar, into ``out/runs/NAME``; then ``extra``."""
    return [
        f"steps={steps}",
        "seed=0",
        "executor=ray",
        "device=cpu",
        "checkpoint=false",
        "progress=false",
        f"out={out / 'runs'}",
        f"name={name.replace(' ', '-')}",
        *extra,
    ]


def reaching(records: list[dict], target: float, window: int = WINDOW) -> tuple[int, float] | None:
    """(step, seconds): the first step (1-based) whose trailing mean reward (over ``window`` steps) reaches
    ``target``, and the wall-clock from the run's start to its end; None if no step's does."""
    elapsed, rewards = 0.0, []
    for step, r in enumerate(records, 1):
        elapsed += r["step_seconds"]
        rewards.append(r["reward"])
        recent = rewards[-window:]
        if sum(recent) / len(recent) >= target:
            return step, round(elapsed, 2)
    return None


def seconds_to(records: list[dict], target: float, window: int = WINDOW) -> float | None:
    """Wall-clock from the run's start to the end of the first step whose trailing mean reward (over ``window``
    steps) reaches ``target``; None if no step's does."""
    reached = reaching(records, target, window)
    return None if reached is None else reached[1]


def summarise(records: list[dict], samples_per_step: int, target: float) -> dict:
    """A run's metrics rows (``RunResult.metrics``) summed up: samples/s over the whole run, wall-clock to
    ``target`` (`seconds_to`), final reward (mean of the last 10 % of steps), median step time over the second
    half (when responses have the trained policy's lengths), the run's total, and the second half's response
    length, staleness and recycled tokens."""
    late = records[len(records) // 2 :]
    tail = records[-max(len(records) // 10, 1) :]
    total = sum(r["step_seconds"] for r in records)
    return {
        "samples_per_s": round(samples_per_step * len(records) / total, 1),
        "seconds_to_target": seconds_to(records, target),
        "final_reward": round(sum(r["reward"] for r in tail) / len(tail), 4),
        "measured_s": round(statistics.median(r["step_seconds"] for r in late), 4),
        "total_s": round(total, 1),
        "response_length": round(statistics.mean(r["response_length"] for r in late), 2),
        "staleness_mean": round(statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in late), 3),
        "recycled_tokens": round(statistics.mean(r.get("rollout/recycled_tokens", 0.0) for r in late), 3),
    }


def start(out: str | None, prefix: str) -> tuple[Path, Any, Any]:
    """Profile this machine (`flowrl profile`'s measurement, all cores) into ``out`` (default: a
    temporary folder), cut it into two devices as ``--cluster cpu:2`` does, and start one private
    Ray for all runs. Returns (folder, hardware, cluster); the caller calls ``ray.shutdown()``."""
    os.environ["FLOWRL_PLUGINS"] = os.environ.get("FLOWRL_PLUGINS") or "ray"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import torch

    from flowrl.backends.local.profile import profile
    from flowrl.planner.hardware import cpu_cluster

    tmp = Path(out or tempfile.mkdtemp(prefix=prefix))
    tmp.mkdir(parents=True, exist_ok=True)
    hw = profile(tmp / "cpu.yaml")
    cluster = cpu_cluster(hw, 2)
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    return tmp, hw, cluster


def plan_variant(
    name: str,
    graph_src: str,
    cluster: Any,
    out: Path,
    *,
    steps: int,
    max_new_tokens: int,
    placement: str | None = None,
    sync: str | None = None,
    require: tuple[str, ...] = (),
    overrides: tuple[str, ...] = (),
) -> tuple[Any, Any]:
    """Plan ``graph_src`` for ``cluster`` (placement and sync pinned, layouts required) with fixed-length
    responses (EOS ignored), to run on Ray for ``steps`` steps into ``out/runs/NAME``. Returns (graph, plan)."""
    from flowrl import api
    from flowrl.contract.plan import ClusterTarget
    from flowrl.planner.constraints import parse_requirements
    from flowrl.planner.workload import Fixed, WorkloadSpec

    given = settings(
        steps, out, name, "rollout.ignore_eos=true", f"rollout.max_new_tokens={max_new_tokens}", *overrides
    )
    loaded, cfg = api.load(graph_src, overrides=given)
    need = parse_requirements(require, loaded.models) if require else None
    w = WorkloadSpec(
        prompts_per_step=cfg.rollout.prompts_per_step,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
        prompt_length=6,  # <s> + at most 4 letters and '>' (the copy task), left-padded
        response_length=Fixed(value=cfg.rollout.max_new_tokens),
        ppo_epochs=cfg.train.epochs,
        mini_batches=cfg.train.mini_batches,
    )
    target = ClusterTarget(cluster=cluster, model=api.model_spec(cfg), workload=w)
    options = {"placement": placement, "weight_sync": sync, "require": need}
    return api.plan(graph_src, overrides=given, target=target, for_backend=True, options=options, emit=lambda s: None)


def run_variant(
    name: str,
    graph_src: str,
    cluster: Any,
    out: Path,
    *,
    steps: int,
    max_new_tokens: int,
    placement: str | None = None,
    sync: str | None = None,
    require: tuple[str, ...] = (),
    overrides: tuple[str, ...] = (),
) -> tuple[Any, Any]:
    """Plan ``graph_src`` for ``cluster`` (placement and sync pinned, layouts required) with fixed-length
    responses (EOS ignored), and run the plan on Ray for ``steps`` steps into ``out/runs/NAME``.
    Returns (the plan, the run's result)."""
    from flowrl import api

    graph, plan = plan_variant(
        name, graph_src, cluster, out, steps=steps, max_new_tokens=max_new_tokens, placement=placement, sync=sync,
        require=require, overrides=overrides,
    )  # fmt: skip
    return plan, api.run(graph, plan)
