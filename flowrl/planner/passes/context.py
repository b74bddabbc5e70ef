"""What a pass may consult besides the plan (`PlanContext`: the graph, the plugin registry, the
caller's typed `PlanOptions`) and what a pass learned besides the plan, one typed result per pass that has any
(`PassResults`; today `place`'s `PlaceResult`, read by ``flowrl plan --explain`` and ``--timeline``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.contract.objective import ObjectiveKind, SampleEfficiency
from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.planner.constraints import Constraints
from flowrl.planner.sample_efficiency import check_objective

if TYPE_CHECKING:
    from flowrl.planner.autotune import TuneResult
    from flowrl.plugins.manager import Registry


class PlanOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the caller asks the passes to plan (``flowrl plan``'s flags; `api.plan`'s ``options``)."""

    budget_s: float = 8.0  # the tuner's search time, split among candidate generation engines
    seed: int = 0  # the simulator's seed
    cost_model: str = "analytic"  # a registered cost model
    placement: str | None = None  # --placement: pin the cluster placement (colocate, separate)
    weight_sync: str | None = None  # --sync: pin the weight-sync strategy
    require: Constraints | None = None  # --require: constraints on the cluster plans searched
    compare: bool = False  # with require: also search unconstrained, for --explain to set beside it
    # --objective: rank by seconds per iteration (throughput) or by predicted time to the target reward
    objective: ObjectiveKind = "throughput"
    target_steps: int | None = None  # --target-steps: iterations a sync run needs to the target (None: config.steps)
    efficiency: SampleEfficiency | None = None  # None: the calibrated one (`flowrl calibrate`), else the prior


def plan_options(given: PlanOptions | Mapping[str, Any] | None) -> PlanOptions:
    """``given`` as `PlanOptions`; a mapping's unknown or mistyped key is refused, naming it."""
    if given is None or isinstance(given, PlanOptions):
        return given or PlanOptions()
    if isinstance(given.get("objective"), str):
        check_objective(given["objective"])
    try:
        options = msgspec.convert(dict(given), PlanOptions)
    except msgspec.ValidationError as exc:
        known = ", ".join(PlanOptions.__struct_fields__)
        raise ConfigError(f"planner options: {exc} (options: {known}).") from None
    if not options.budget_s > 0:  # NaN too; infinity: every candidate simulated
        raise ConfigError(
            f"planner options: budget_s is {options.budget_s}; give the search time in seconds (> 0), or "
            "float('inf') to simulate every candidate."
        )
    return options


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
    options: PlanOptions = field(default_factory=PlanOptions)
    results: PassResults = field(default_factory=PassResults)
