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
