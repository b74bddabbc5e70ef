"""flowrl's Ray backend: a plan's device groups as Ray actors (`flowrl run --executor ray`)."""

from __future__ import annotations

from typing import Any

from flowrl.contract import hookimpl


@hookimpl
def register_executors(register: Any) -> None:
    from flowrl_ray.executor import RayExecutor, machine, nodes  # Ray itself loads only when a run starts

    register(
        "ray",
        RayExecutor,
        machine=machine,
        nodes=nodes,
        description="each device of the plan a Ray actor: FSDP2 data parallel, planned weight sync",
    )
