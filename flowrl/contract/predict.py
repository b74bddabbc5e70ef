"""What a finished run's measured timeline is drawn against: a forecast of the plan's iterations.

The executor does not plan: its caller (the API, the CLI) passes it a `Predictor`, which the
planner implements by replaying the plan through its simulator (`flowrl.planner.predict`). A run
without one draws only what it measured. `steady` is the rule both sides read a run's trace by:
the iterations past warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from flowrl.contract.plan import ExecutionPlan
    from flowrl.graph.ir import Graph

#: One task of a timeline: (task, device groups, start s, end s, iteration).
Span = tuple[str, tuple[str, ...], float, float, int]


@dataclass(frozen=True)
class Forecast:
    """A plan's predicted iterations: every task's span (the driver's work on group ``controller``)
    and the seconds per iteration."""

    spans: list[Span] = field(default_factory=list)
    iteration_s: float = 0.0


@runtime_checkable
class Predictor(Protocol):
    def predict(self, graph: Graph, plan: ExecutionPlan) -> Forecast:
        """The forecast of ``plan``'s layout as it was placed (an empty one for a plan it cannot
        replay, such as one without a layout or a workload)."""
        ...


def steady(iterations: list[int]) -> list[int]:
    """The iterations past warm-up, in order: all but the first ``max(2, n // 10)``."""
    ordered = sorted(set(iterations))
    return ordered[max(2, len(ordered) // 10) :]
