"""What a pass may consult besides the plan: the graph, the plugin registry and the caller's
options; and what a pass learned besides the plan (its by-products, read by ``--explain``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowrl.graph.ir import Graph

if TYPE_CHECKING:
    from flowrl.plugins.manager import Registry


@dataclass
class PlanContext:
    """What passes may consult besides the plan: the graph, plugins, by-products, options."""

    graph: Graph
    registry: Registry
    cache: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # budget_s, seed, cost_model
