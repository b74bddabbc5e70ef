"""The local executor: the in-process executor on this machine's one device."""

from __future__ import annotations

from flowrl.backends.local.device import machine, resolve_device
from flowrl.contract.capabilities import Capabilities
from flowrl.contract.numerics import Numerics
from flowrl.contract.plan import ExecutionPlan
from flowrl.graph.ir import Graph
from flowrl.runtime.executor import PlanExecutor

#: fp32 weights, gradients and AdamW moments; activations kept for backward; eager attention;
#: a replica decodes its whole batch at once; no reserve (the CPU has no allocator pool).
LOCAL_NUMERICS = Numerics(
    weight_bytes=4,
    grad_bytes=4,
    optimizer_bytes=8,
    activation_bytes=4,
    recompute=False,
    eager_attention=True,
    decode_batch=None,
    offload_for_rollout=False,
    reserve=0.0,
    generation_in_place=True,  # the torch engine samples with the weights it trains
)


class LocalExecutor(PlanExecutor):
    """Every model in this process on one device (CPU or one GPU), generation in place."""

    capabilities = Capabilities(
        max_devices=1,
        placements=("colocate",),
        rollout_modes=("sync", "one_step_off", "async"),
        partial_rollouts=True,
        streaming=True,
        weight_sync=("reshard",),
        model_parallel=False,
        pipeline_parallel=False,
        optimizer_offload=True,  # the states of a one-process GPU model in host memory between steps
        numerics=LOCAL_NUMERICS,
    )

    def device(self, plan: ExecutionPlan) -> str:
        return resolve_device(plan.config.device)

    def check(self, graph: Graph, plan: ExecutionPlan) -> None:
        super().check(graph, plan)
        self.device(plan)


__all__ = ["LocalExecutor", "machine"]
