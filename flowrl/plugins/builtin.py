"""flowrl's own components, registered through the same hooks as any plugin."""

from __future__ import annotations

from typing import Any

from flowrl.plugins.hookspecs import Register, hookimpl


def _doc(obj: Any) -> str:
    return (obj.__doc__ or "").strip().splitlines()[0] if obj.__doc__ else ""


BUILTIN_GRAPHS = (
    "ppo",
    "ppo_rm",
    "grpo",
    "remax",
    "rloo",
    "reinforce_pp",
    "dapo",
    "safe_rlhf",
    "tool_use",
    "two_agent",
)


@hookimpl
def register_algorithms(register: Register) -> None:
    import importlib

    for name in BUILTIN_GRAPHS:
        module = importlib.import_module(f"flowrl.graphs.{name}")
        register(name, module.build, description=_doc(module), source=module.__file__)


@hookimpl
def register_compute_functions(register: Register) -> None:
    from flowrl.algorithms.ops import COMPUTE_FUNCTIONS

    for name, (fn, meta) in COMPUTE_FUNCTIONS.items():
        register(name, fn, description=_doc(fn), **meta)


@hookimpl
def register_losses(register: Register) -> None:
    from flowrl.algorithms.ops import LOSSES

    for name, (fn, meta) in LOSSES.items():
        register(name, fn, description=_doc(fn), **meta)


@hookimpl
def register_reward_functions(register: Register) -> None:
    from flowrl.algorithms.ops import REWARD_FUNCTIONS

    for name, fn in REWARD_FUNCTIONS.items():
        register(name, fn, description=_doc(fn))


@hookimpl
def register_filters(register: Register) -> None:
    from flowrl.algorithms.ops import FILTERS

    for name, (fn, meta) in FILTERS.items():
        register(name, fn, description=_doc(fn), **meta)


@hookimpl
def register_environments(register: Register) -> None:
    from flowrl.tasks.environments import ENVIRONMENTS

    for name, factory in ENVIRONMENTS.items():
        register(name, factory, description=_doc(factory))


@hookimpl
def register_agents(register: Register) -> None:
    from flowrl.agents.command import command
    from flowrl.agents.openenv_env import openenv_agent
    from flowrl.agents.verifiers_env import verifiers_agent

    register("command", command, description=_doc(command))
    register("verifiers", verifiers_agent, description=_doc(verifiers_agent))
    register("openenv", openenv_agent, description=_doc(openenv_agent))


@hookimpl
def register_tasks(register: Register) -> None:
    from flowrl.tasks.builtin import BUILTIN_TASKS
    from flowrl.tasks.dataset import DataTask
    from flowrl.tasks.openenv_task import OpenEnvSeeds
    from flowrl.tasks.reasoning_gym_task import ReasoningGymTask  # reasoning_gym itself loads when the task is built
    from flowrl.tasks.verifiers_task import VerifiersTask  # verifiers itself loads when the task is built

    classes = (DataTask, ReasoningGymTask, VerifiersTask, OpenEnvSeeds)
    for name, cls in {**BUILTIN_TASKS, **{cls.name: cls for cls in classes}}.items():
        register(name, cls, description=cls.description)


@hookimpl
def register_executors(register: Register) -> None:
    from flowrl.backends.local.executor import LocalExecutor, machine

    register(
        "local",
        LocalExecutor,
        machine=machine,
        description="every model in this process on one device (CPU or one GPU)",
    )


def _local_generation_engine(ctx: Any) -> Any:  # torch loads only when an engine is built
    from flowrl.backends.local.factories import generation_engine

    return generation_engine(ctx)


def _local_training_engine(ctx: Any) -> Any:
    from flowrl.backends.local.factories import training_engine

    return training_engine(ctx)


@hookimpl
def register_generation_engines(register: Register) -> None:
    from flowrl.contract.capabilities import EngineCapabilities

    register(
        "local",
        _local_generation_engine,
        description="torch sampling with a KV cache, in this process",
        capabilities=EngineCapabilities(model_parallel=False, optimizer_offload=False),
    )


@hookimpl
def register_training_engines(register: Register) -> None:
    from flowrl.contract.capabilities import EngineCapabilities

    register(
        "local",
        _local_training_engine,
        description="HF models in this process: forward, AdamW train steps (FSDP2 data parallel x DTensor "
        "tensor parallel x pipeline stages over a group)",
        # tensor parallel: DTensor over a group's tp ranks (flowrl/backends/local/parallelize/tensor.py); pipeline:
        # stages over its pp ranks by torch.distributed.pipelining's schedules (parallelize/pipeline.py)
        # offload: FSDP2's CPUOffloadPolicy on a group, optimizer states in host memory between steps in one process
        capabilities=EngineCapabilities(
            model_parallel=True, pipeline_parallel=True, optimizer_offload=True, own_outputs=True
        ),
    )


@hookimpl
def register_passes(register: Register) -> None:
    from flowrl.planner.passes import BUILTIN_PASSES

    for name, fn in BUILTIN_PASSES.items():
        register(name, fn, description=_doc(fn))


@hookimpl
def register_hardware(register: Register) -> None:
    from flowrl.planner.hardware import HARDWARE_PRESETS

    for name, spec in HARDWARE_PRESETS.items():
        register(
            name,
            spec,
            description=f"{spec.peak_flops_bf16 / 1e12:.0f} TFLOP/s bf16, {spec.memory_bytes / 1024**3:.0f} "
            f"GiB, {spec.memory_bandwidth / 1e12:.2f} TB/s",
        )


@hookimpl
def register_cost_models(register: Register) -> None:
    from flowrl.planner.cost import CostModel

    register("analytic", CostModel, description=_doc(CostModel))


def _profile_arguments(p: Any) -> None:  # here, not in the profiler: `flowrl --help` does not import torch
    p.add_argument(
        "--out", metavar="FILE", help="where to write the HardwareSpec YAML (also saved for --cluster local)"
    )
    p.add_argument("--force", action="store_true", help="replace --out if it already exists")


def _profile(args: Any) -> int:
    from flowrl.backends.local.profile import run

    return run(args)


@hookimpl
def register_cli_commands(register: Register) -> None:
    """The core commands live in flowrl.cli; the local backend adds `flowrl profile`."""
    register(
        "profile", _profile_arguments, run=_profile, help="measure this machine and fit the planner's cost model to it"
    )
