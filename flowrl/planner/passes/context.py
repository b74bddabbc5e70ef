"""What a pass may consult besides the plan (`PlanContext`: the graph, the plugin registry, the
caller's options) and what a pass learned besides the plan, one typed result per pass that has any
(`PassResults`; today `place`'s `PlaceResult`, read by ``flowrl plan --explain`` and ``--timeline``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowrl.graph.ir import Graph

if TYPE_CHECKING:
    from flowrl.planner.autotune import TuneResult
    from flowrl.plugins.manager import Registry


@dataclass(frozen=True)
class PlaceResult:
    """What `place` learned besides the layout it wrote into the plan."""

    #: the tuner's ranking of the chosen generation engine's candidates (None: no rollout, nothing simulated)
    tune: TuneResult | None = None
    #: ``generation.engine=auto`` choosing among several engines: each one's predicted step seconds
    engines: Mapping[str, float] = field(default_factory=dict)
    #: ``require`` with ``compare``: the ranking of the unconstrained search, to set beside ``tune``
    unconstrained: TuneResult | None = None


@dataclass
class PassResults:
    """The by-products of a pipeline's passes, one field per pass that has any; None: it did not run."""

    place: PlaceResult | None = None


@dataclass
class PlanContext:
    """What passes may consult besides the plan (graph, plugins, options) and where they leave
    their typed by-products (``results``)."""

    graph: Graph
    registry: Registry
    options: dict[str, Any] = field(default_factory=dict)  # budget_s, seed, cost_model, pins, require, compare
    results: PassResults = field(default_factory=PassResults)
