"""The one table of what plugins register: each kind's name, hook, wording, and how flowrl calls it.

Hooks (``hookspecs.HOOKS``), the checks made at registration (``manager``), look-ups and the
functions graph nodes call (``manager.node_functions``) all derive from :data:`KINDS`; a new kind is one
row here plus its hookspec. ``aliases`` are older names of a kind: a plugin implementing
``register_<alias>`` still fills it, and a registry look-up by the alias still finds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kind:
    """One kind of thing plugins register."""

    name: str  # the registry's kind, e.g. "compute_functions"; its hook is register_<name>
    singular: str  # how messages name one entry: "compute function"
    call: str | None = None  # how flowrl calls what is registered; None: not called (classes, presets)
    #: callables passed as metadata: key -> (how flowrl calls it, whether it is required)
    meta_calls: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    node_function: bool = False  # a graph node calls it (the executor hands these to the nodes)
    aliases: tuple[str, ...] = ()  # older names: hook register_<alias> and look-ups by the alias still work

    @property
    def hook(self) -> str:
        return f"register_{self.name}"

    @property
    def hooks(self) -> tuple[str, ...]:
        """The hook, then the hooks of its older names."""
        return (self.hook, *(f"register_{a}" for a in self.aliases))


KINDS: tuple[Kind, ...] = (
    Kind("algorithms", "algorithm", "build(cfg)"),
    Kind(
        "compute_functions",
        "compute function",
        "fn(inputs, algo, **options)",
        node_function=True,
        aliases=("advantage_estimators",),
    ),
    Kind("losses", "loss", "fn(outputs, batch, algo, **options)", node_function=True),
    Kind("reward_functions", "reward function", "fn(prompts, responses, task, **options)", node_function=True),
    Kind("filters", "filter function", "fn(inputs, algo, **options)", node_function=True),
    Kind("environments", "environment", "factory(task, **options)", node_function=True),
    Kind("agents", "agent", "factory(task, **options)", node_function=True),
    Kind("tasks", "task"),
    Kind(
        "executors",
        "executor",
        "factory(registry)",
        # machine: this machine as one device; nodes: the alive nodes (flowrl.contract.ClusterNode) of the
        # cluster at --address, which the planner plans for (flowrl.planner.nodes)
        meta_calls={"machine": ("machine(cfg)", False), "nodes": ("nodes(address)", False)},
    ),
    Kind("generation_engines", "generation engine", "factory(ctx)"),
    Kind("training_engines", "training engine", "factory(ctx)"),
    Kind("passes", "pass", "fn(ctx, plan)"),
    Kind("hardware", "hardware preset"),
    Kind("cost_models", "cost model", "factory(model, hardware)"),
    Kind("cli_commands", "CLI command", "add_arguments(parser)", meta_calls={"run": ("run(args)", True)}),
)

BY_NAME: dict[str, Kind] = {k.name: k for k in KINDS}

#: an older kind name -> the kind's name today
ALIASES: dict[str, str] = {alias: k.name for k in KINDS for alias in k.aliases}

#: hook name -> kind name (the hooks of older names included)
HOOKS: dict[str, str] = {hook: k.name for k in KINDS for hook in k.hooks}

#: the kinds graph nodes call: compute, loss, reward, filter functions and environments
NODE_FUNCTION_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS if k.node_function)


def canonical(kind: str) -> str:
    """``kind``'s name today (an older name such as ``advantage_estimators`` -> ``compute_functions``)."""
    return ALIASES.get(kind, kind)
