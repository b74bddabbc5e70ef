"""flowrl's plugin hooks. Each hook receives a ``register(name, obj, **meta)`` callback.

Built-ins implement these hooks exactly like third-party plugins (entry-point group ``flowrl``).
"""

from __future__ import annotations

from typing import Any

import pluggy

from flowrl.contract.hooks import Register, hookimpl  # one marker and type (plugins import them from flowrl.contract)
from flowrl.plugins import kinds

hookspec = pluggy.HookspecMarker("flowrl")


@hookspec
def register_algorithms(register: Register) -> None:
    """Register algorithm graphs: ``register(name, build)`` where ``build(cfg) -> Graph``."""


@hookspec
def register_compute_functions(register: Register) -> None:
    """Register compute functions: ``register(name, fn, needs=(ports), gives=(ports))``; compute nodes call them."""


@hookspec
def register_advantage_estimators(register: Register) -> None:
    """The older name of ``register_compute_functions``: what it registers are compute functions."""


@hookspec
def register_losses(register: Register) -> None:
    """Register train losses: ``register(name, fn, needs=(keys), output="logprobs"|"values",
    aggregate="token-mean"|"seq-mean"|"sum", rows="each"|"pairs")`` (what the loss is a mean over, and
    whether it reads preference pairs: see flowrl.register.loss)."""


@hookspec
def register_reward_functions(register: Register) -> None:
    """Register rule-based rewards: ``register(name, fn)`` with ``fn(prompts, responses, task, **options)``."""


@hookspec
def register_filters(register: Register) -> None:
    """Register filter functions: ``register(name, fn, needs=(ports))`` with ``fn(inputs, algo, **options)``
    returning one bool per group (prompt) or per row: which groups a filter node keeps."""


@hookspec
def register_environments(register: Register) -> None:
    """Register environments for multi-turn generation: ``register(name, factory)`` with
    ``factory(task, **options)`` returning an object with ``reply(prompt, turns) -> str | None``
    (the environment's answer to the model's turns so far; None ends the episode)."""


@hookspec
def register_agents(register: Register) -> None:
    """Register agents for generate nodes with ``agent=NAME``: ``register(name, factory)`` with
    ``factory(task, **options)`` returning a callable (sync or async) that plays one episode against
    the policy's OpenAI-compatible endpoint and returns its reward (`flowrl.agents`)."""


@hookspec
def register_tasks(register: Register) -> None:
    """Register verifiable tasks: ``register(name, task_class)``."""


@hookspec
def register_executors(register: Register) -> None:
    """Register executors: ``register(name, factory, machine=fn)``; ``factory(registry) -> Executor``,
    ``machine(cfg) -> HardwareSpec``."""


@hookspec
def register_generation_engines(register: Register) -> None:
    """Register generation engines: ``register(name, factory)`` with
    ``factory(ctx: EngineContext) -> GenerationEngine``."""


@hookspec
def register_training_engines(register: Register) -> None:
    """Register training engines: ``register(name, factory)`` with ``factory(ctx: EngineContext) -> TrainingEngine``."""


@hookspec
def register_passes(register: Register) -> None:
    """Register planner passes: ``register(name, fn)``, ``fn(ctx: PlanContext, plan) -> plan`` (planner.passes)."""


@hookspec
def register_hardware(register: Register) -> None:
    """Register accelerator presets for ``--cluster NxNAME``: ``register(name, HardwareSpec)``."""


@hookspec
def register_cost_models(register: Register) -> None:
    """Register planner cost models: ``register(name, factory)`` with ``factory(model, hardware) -> CostModel``."""


@hookspec
def register_cli_commands(register: Register) -> None:
    """Register CLI sub-commands: ``register(name, add_arguments, run, help="...")``."""


#: hook name -> the kind it fills (derived from the one table, flowrl.plugins.kinds)
HOOKS: dict[str, str] = kinds.HOOKS

__all__ = ["hookimpl", "hookspec", "HOOKS", "Any"]
