"""The planner's forecast of a plan a run executes: its simulator replays the plan as placed
(`flowrl.contract.predict.Predictor`, which the API hands the executor)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.contract.predict import Forecast

if TYPE_CHECKING:
    from flowrl.contract.plan import ExecutionPlan
    from flowrl.graph.ir import Graph
    from flowrl.plugins.manager import Registry


class Simulator:
    """Predicts a plan's iterations with the simulator, costing it with the functions, engines
    and cost models of ``registry``."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def predict(self, graph: Graph, plan: ExecutionPlan) -> Forecast:
        from flowrl.planner.passes import replay

        if plan.layout is None or plan.target.workload is None:
            return Forecast()
        result = replay(graph, plan, self.registry)
        spans = [(s.task, s.groups or ("controller",), s.start, s.end, s.iteration) for s in result.spans]
        return Forecast(spans=spans, iteration_s=result.iteration_s)
