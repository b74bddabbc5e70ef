"""A node's options: the graph's, with the config's ``nodes.NAME`` over them, checked against its
function's keyword arguments and the algorithm config (read by `resolve`).
"""

from __future__ import annotations

import inspect
import typing
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.contract.resolved import NodeOptions
from flowrl.errors import ConfigError, GraphError, did_you_mean
from flowrl.graph.ir import Compute, Filter, Generate, Graph, Reward, Train
from flowrl.specs import AlgoConfig, RunConfig, algo_problems

if TYPE_CHECKING:
    from flowrl.plugins.manager import Registry


TRAIN_OPTIONS = ("epochs", "mini_batches")


ALGO_FIELDS = frozenset(AlgoConfig.__struct_fields__)


def node_plan_options(graph: Graph, name: str, cfg: RunConfig, registry: Registry) -> NodeOptions:
    """A node's resolved options (the graph's, with the config's ``nodes.NAME`` over them); a train
    node's epochs and mini-batches default to the config's."""
    algo, options = node_options(graph, name, cfg.algo, registry, configured_options(graph, cfg, name))
    if isinstance(graph.nodes[name], Train):
        options = {"epochs": cfg.train.epochs, "mini_batches": cfg.train.mini_batches, **options}
    return NodeOptions(algo=algo, options=options)


def configured_options(graph: Graph, cfg: RunConfig, name: str) -> dict[str, Any]:
    """The options the config sets for node ``name`` (``nodes: {NAME: {OPTION: VALUE}}``, ``--set
    nodes.NAME.OPTION=VALUE``); a node the graph does not have is refused, naming the graph's nodes."""
    for given in cfg.nodes:
        if given not in graph.nodes:
            raise ConfigError(
                f"config field 'nodes.{given}': graph '{graph.name}' has no node '{given}'."
                f"{did_you_mean(given, list(graph.nodes))} Its nodes: {', '.join(graph.nodes)}."
            )
    return cfg.nodes.get(name, {})


def node_options(
    graph: Graph, name: str, algo: AlgoConfig, registry: Registry, configured: dict[str, Any] | None = None
) -> tuple[AlgoConfig, dict[str, Any]]:
    """A node's options: the graph's, with ``configured`` (the config's ``nodes.NAME``) over them.
    Those naming AlgoConfig fields override ``algo``; the rest must be keyword arguments of its
    function (train nodes: epochs, mini_batches)."""
    node = graph.nodes[name]
    given = {**node.options, **(configured or {})}
    overrides = {k: v for k, v in given.items() if k in ALGO_FIELDS}
    rest = {k: v for k, v in given.items() if k not in ALGO_FIELDS}
    fn = _function(registry, node)
    if isinstance(node, Generate) and node.agent is not None:
        _check_agent(node, fn, rest)
    allowed = (*TRAIN_OPTIONS, *_keyword_arguments(fn)) if isinstance(node, Train) else _keyword_arguments(fn)
    bad = [k for k in rest if k not in allowed]
    fields = [k for k in bad if k in type(node).__struct_fields__ and k in (configured or {})]
    if fields:
        raise GraphError(
            f"node '{name}': {', '.join(fields)} {'is a field' if len(fields) == 1 else 'are fields'} of the "
            f"{node.kind} node in the graph (set in the graph file, where `flowrl show` reads it), not an option; "
            f"`--set nodes.{name}.OPTION` sets the keyword options of its function only. Change it in the graph, "
            "or give the graph's build() a config-driven value."
        )
    if bad:
        known = ", ".join(sorted([*allowed, *ALGO_FIELDS]))
        configs = [f"nodes.{name}.{k}" for k in bad if k in (configured or {})]
        by = f" (set by the config: {', '.join(configs)})" if configs else ""
        raise GraphError(f"node '{name}': unknown option(s) {', '.join(bad)}{by}; allowed: {known}.")
    _check_option_types(name, fn, rest)
    try:
        algo = msgspec.convert({**msgspec.to_builtins(algo), **overrides}, AlgoConfig)
    except msgspec.ValidationError as exc:
        raise GraphError(f"node '{name}': bad option: {exc}") from None
    for key, why in algo_problems(algo):
        if key in overrides:
            where = f"nodes.{name}.{key}" if key in (configured or {}) else f"option '{key}'"
            raise GraphError(f"node '{name}': {where} = {overrides[key]!r} {why}.")
    for key in TRAIN_OPTIONS:
        if key in rest and (isinstance(rest[key], bool) or not isinstance(rest[key], int) or rest[key] < 1):
            raise GraphError(f"node '{name}': option '{key}' must be an integer >= 1, got {rest[key]!r}.")
    return algo, rest


def _check_agent(node: Generate, fn: Any, options: dict[str, Any]) -> None:
    """A plain agent callable can be called with what the run gives it (`flowrl.agents.ARGUMENTS`) and
    the node's options, and no option takes the place of one of those arguments."""
    import inspect

    from flowrl import agents

    assert node.agent is not None
    shadowed = sorted(set(options) & set(agents.ARGUMENTS))
    if shadowed:
        raise GraphError(
            f"node '{node.name}': option(s) {', '.join(shadowed)} would replace what the run gives the agent "
            f"({', '.join(agents.ARGUMENTS)}); rename them."
        )
    if not agents.is_reference(node.agent):
        return
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    given = set(agents.ARGUMENTS) | set(options)
    needed = [
        p.name
        for p in params
        if p.default is p.empty
        and (
            p.kind is p.POSITIONAL_ONLY or (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in given)
        )
    ]
    if needed:
        raise GraphError(
            f"node '{node.name}': agent '{node.agent}' needs argument(s) {', '.join(needed)}, which the run does "
            f"not give: it calls an agent with the keyword arguments it names of {', '.join(agents.ARGUMENTS)}, "
            "and the node's options."
        )


def agent_function(registry: Registry, node: Generate) -> Any:
    """What a generate node's ``agent`` names: a registered agent's factory, or the callable a
    ``module:function`` / ``file.py:function`` reference loads (a GraphError naming the node if none)."""
    from flowrl import agents

    assert node.agent is not None
    if agents.is_reference(node.agent):
        return agents.load(node.agent, node.name)
    return registry.entry("agents", node.agent).obj


def _function(registry: Registry, node: Any) -> Any:
    """The registered function a node calls: compute, reward and filter functions, an environment,
    a train node's loss (None for other kinds)."""
    if isinstance(node, Compute):
        return registry.get("compute_functions", node.fn)
    if isinstance(node, Reward):
        return registry.get("reward_functions", node.fn)
    if isinstance(node, Filter):
        return registry.get("filters", node.fn)
    if isinstance(node, Generate) and node.env is not None:
        return registry.get("environments", node.env)
    if isinstance(node, Generate) and node.agent is not None:
        return agent_function(registry, node)
    if isinstance(node, Train):
        return registry.get("losses", node.loss)
    return None


def _check_option_types(node: str, fn: Any, options: dict[str, Any]) -> None:
    """Each option against the annotation of the function's keyword argument, when it has one."""
    if fn is None or not options:
        return
    try:
        hints = typing.get_type_hints(fn, include_extras=True)  # with msgspec.Meta bounds (beta > 0)
    except Exception:  # unresolvable annotations: nothing to check against
        return
    for key, value in options.items():
        if key in hints:
            try:
                msgspec.convert(value, hints[key])
            except (msgspec.ValidationError, TypeError) as exc:
                raise GraphError(f"node '{node}': option '{key}' = {value!r} does not fit its type ({exc}).") from None


def _keyword_arguments(fn: Any) -> tuple[str, ...]:
    if fn is None:
        return ()
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in keyword and (p.kind == p.KEYWORD_ONLY or p.default is not p.empty))
