"""Shared by the benchmarks that run plans on this machine as ``cpu:2`` through Ray."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


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

    settings = [
        f"steps={steps}",
        "seed=0",
        "executor=ray",
        "device=cpu",
        "checkpoint=false",
        "progress=false",
        "rollout.ignore_eos=true",
        f"rollout.max_new_tokens={max_new_tokens}",
        f"out={out / 'runs'}",
        f"name={name.replace(' ', '-')}",
        *overrides,
    ]
    loaded, cfg = api.load(graph_src, overrides=settings)
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
    return api.plan(
        graph_src, overrides=settings, target=target, for_backend=True, options=options, emit=lambda s: None
    )


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
