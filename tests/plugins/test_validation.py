"""What plugins register is checked at registration, and errors in a plugin's hook name the plugin and the hook."""

from __future__ import annotations

import types
from typing import Any

import pytest

from flowrl.contract.capabilities import Capabilities
from flowrl.errors import PluginError
from flowrl.planner.hardware import HARDWARE_PRESETS
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.kinds import KINDS
from flowrl.plugins.manager import CALLS, CORE_COMMANDS, SINGULAR, Registry, load_plugins

HOOK_OF = {k.name: k.hook for k in KINDS}


def plugin(kind: str, name: str, obj: Any, **meta: Any) -> types.ModuleType:
    """A module-style plugin whose hook for ``kind`` registers ``obj`` as ``name`` with ``meta``."""
    module = types.ModuleType("flowrl_test_plugin")

    @hookimpl
    def hook(register: Any) -> None:
        register(name, obj, **meta)

    setattr(module, HOOK_OF[kind], hook)
    return module


def load(*plugins: tuple[str, Any]) -> Registry:
    return load_plugins(entry_points=False, extra=plugins)[1]


class GoodExecutor:
    capabilities = Capabilities()

    def __init__(self, registry: Any) -> None:
        self.registry = registry


def test_an_executor_without_capabilities_is_refused() -> None:
    message = refusal("executors", lambda registry: None)
    assert "no 'capabilities' attribute" in message and "Capabilities" in message


def refusal(kind: str, obj: Any, name: str = "x", **meta: Any) -> str:
    """The message of the PluginError raised when plugin 'bad' registers ``obj`` as the ``kind`` ``name``."""
    with pytest.raises(PluginError) as info:
        load(("bad", plugin(kind, name, obj, **meta)))
    message = str(info.value)
    assert message.startswith(f"plugin 'bad' registered {SINGULAR[kind]} '{name}', but "), message
    return message


def run_command(args: Any) -> int:
    return 0


def add_arguments(parser: Any) -> None:
    pass


# ---------------------------------------------------------------------------- a good plugin of each kind


class GoodTask:
    pass


class GoodCostModel:
    def __init__(self, model: Any, hardware: Any) -> None:
        self.model, self.hardware = model, hardware


class Good:
    """One valid registration of every kind, each named 'good'."""

    @hookimpl
    def register_algorithms(self, register: Any) -> None:
        register("good", lambda cfg: None)

    @hookimpl
    def register_compute_functions(self, register: Any) -> None:
        def fn(inputs: Any, algo: Any, *, gamma: float = 1.0) -> dict[str, Any]:
            return {}

        register("good", fn, needs=["rewards"], gives=("advantages",))

    @hookimpl
    def register_losses(self, register: Any) -> None:
        register("good", lambda outputs, batch, algo: (0.0, {}), needs=("advantages",), output="values")

    @hookimpl
    def register_reward_functions(self, register: Any) -> None:
        register("good", lambda prompts, responses, task, **options: None)

    @hookimpl
    def register_filters(self, register: Any) -> None:
        register("good", lambda inputs, algo, **options: None, needs=("rewards",))

    @hookimpl
    def register_environments(self, register: Any) -> None:
        register("good", lambda task, **options: None)

    @hookimpl
    def register_agents(self, register: Any) -> None:
        register("good", lambda task, **options: None)

    @hookimpl
    def register_tasks(self, register: Any) -> None:
        register("good", GoodTask)

    @hookimpl
    def register_executors(self, register: Any) -> None:
        register("good", GoodExecutor, machine=lambda cfg: None)

    @hookimpl
    def register_generation_engines(self, register: Any) -> None:
        register("good", lambda ctx: None)

    @hookimpl
    def register_training_engines(self, register: Any) -> None:
        register("good", lambda ctx: None)

    @hookimpl
    def register_passes(self, register: Any) -> None:
        register("good", lambda ctx, plan: plan)

    @hookimpl
    def register_hardware(self, register: Any) -> None:
        register("good", HARDWARE_PRESETS["H20"])

    @hookimpl
    def register_cost_models(self, register: Any) -> None:
        register("good", GoodCostModel)

    @hookimpl
    def register_cli_commands(self, register: Any) -> None:
        register("good", add_arguments, run=run_command, help="a plugin command")


def test_a_good_plugin_of_each_kind_loads() -> None:
    reg = load(("good_plugin", Good()))
    for kind in HOOK_OF:
        assert reg.entry(kind, "good").plugin == "good_plugin", kind
    assert reg.entry("cli_commands", "good").meta["run"] is run_command
    assert reg.get("cost_models", "good") is GoodCostModel


def test_uninspectable_builtin_is_accepted() -> None:
    assert load(("builtin_fn", plugin("losses", "max", max))).get("losses", "max") is max


# ---------------------------------------------------------------------------- exceptions in hooks


class Raises:
    @hookimpl
    def register_losses(self, register: Any) -> None:
        raise ValueError("boom")


def test_exception_in_hook_names_plugin_and_hook() -> None:
    with pytest.raises(PluginError) as info:
        load(("foo", Raises()))
    assert str(info.value) == "plugin 'foo' failed in hook register_losses: ValueError: boom"
    assert isinstance(info.value.__cause__, ValueError)


def test_exception_in_module_plugin_hook_names_it() -> None:
    module = types.ModuleType("flowrl_test_broken")

    @hookimpl
    def register_passes(register: Any) -> None:
        register("fine", lambda ctx, plan: plan)
        {}["missing"]

    module.register_passes = register_passes  # type: ignore[attr-defined]
    with pytest.raises(PluginError, match=r"^plugin 'broken' failed in hook register_passes: KeyError: 'missing'$"):
        load(("broken", module))


class RaisesPluginError:
    @hookimpl
    def register_tasks(self, register: Any) -> None:
        raise PluginError("my own words")


def test_plugin_error_raised_by_the_plugin_itself_is_still_attributed() -> None:
    with pytest.raises(PluginError, match=r"^plugin 'own' failed in hook register_tasks: PluginError: my own words$"):
        load(("own", RaisesPluginError()))


def test_refusal_by_register_is_not_wrapped() -> None:
    message = refusal("losses", 42)
    assert "failed in hook" not in message


class SwallowsRefusal:
    @hookimpl
    def register_losses(self, register: Any) -> None:
        try:
            register("x", 42)
        except PluginError as exc:
            raise RuntimeError("gave up") from exc


def test_error_raised_while_handling_a_refusal_is_attributed() -> None:
    with pytest.raises(PluginError, match=r"^plugin 'swallow' failed in hook register_losses: RuntimeError: gave up$"):
        load(("swallow", SwallowsRefusal()))


# ---------------------------------------------------------------------------- object checks


@pytest.mark.parametrize("kind", sorted(CALLS))
def test_non_callable_is_refused(kind: str) -> None:
    meta = {"run": run_command} if kind == "cli_commands" else {}
    message = refusal(kind, 42, **meta)
    assert f"42 is not callable: flowrl calls {CALLS[kind]}" in message


def test_task_must_be_a_class() -> None:
    assert "is not a class" in refusal("tasks", GoodTask())


def test_hardware_must_be_a_hardware_spec() -> None:
    message = refusal("hardware", {"name": "H20"})
    assert "{'name': 'H20'} is not a flowrl.planner.hardware.HardwareSpec" in message


def too_few(a: Any) -> None:
    pass


def needs_keyword(*args: Any, required: Any) -> None:
    pass


@pytest.mark.parametrize(
    ("kind", "fn", "why"),
    [
        ("losses", lambda outputs, batch: None, "too many positional arguments"),
        ("losses", lambda outputs, batch, algo, extra: None, "missing a required argument: 'extra'"),
        ("compute_functions", too_few, "too many positional arguments"),
        ("reward_functions", lambda prompts, responses: None, "too many positional arguments"),
        ("passes", lambda plan: plan, "too many positional arguments"),
        ("algorithms", lambda: None, "too many positional arguments"),
        ("cost_models", too_few, "too many positional arguments"),
        ("generation_engines", lambda: None, "too many positional arguments"),
        ("training_engines", lambda ctx, extra: None, "missing a required argument: 'extra'"),
        ("executors", lambda: None, "too many positional arguments"),
        ("reward_functions", needs_keyword, "missing a required argument: 'required'"),
    ],
)
def test_wrong_signature_is_refused(kind: str, fn: Any, why: str) -> None:
    message = refusal(kind, fn)
    assert f"cannot be called as {CALLS[kind]} ({why})" in message


class CostModelTakingOneArgument:
    def __init__(self, model: Any) -> None:
        self.model = model


def test_class_signature_is_checked_through_its_constructor() -> None:
    message = refusal("cost_models", CostModelTakingOneArgument)
    assert "CostModelTakingOneArgument" in message and "cannot be called as factory(model, hardware)" in message


# ---------------------------------------------------------------------------- metadata checks


def test_loss_output_must_be_logprobs_or_values() -> None:
    message = refusal("losses", lambda outputs, batch, algo: None, output="logits")
    assert "meta 'output' is 'logits'; it must be one of 'logprobs', 'values'" in message


@pytest.mark.parametrize(
    ("kind", "key", "value"),
    [
        ("losses", "needs", "advantages"),  # a bare string, not a tuple of keys
        ("losses", "gives", ("advantages", 1)),
        ("compute_functions", "needs", None),
        ("compute_functions", "gives", {"advantages"}),
    ],
)
def test_needs_and_gives_must_be_lists_of_strings(kind: str, key: str, value: Any) -> None:
    fn = (lambda outputs, batch, algo: None) if kind == "losses" else (lambda inputs, algo: None)
    message = refusal(kind, fn, **{key: value})
    assert f"meta '{key}' is {value!r}; it must be a tuple or list of strings" in message


def test_executor_machine_must_be_callable() -> None:
    message = refusal("executors", GoodExecutor, machine="H20")
    assert "for meta 'machine', 'H20' is not callable: flowrl calls machine(cfg)" in message


def test_executor_machine_signature_is_checked() -> None:
    message = refusal("executors", GoodExecutor, machine=lambda: None)
    assert "for meta 'machine'" in message and "cannot be called as machine(cfg)" in message


# ---------------------------------------------------------------------------- CLI commands


def test_cli_command_needs_run() -> None:
    message = refusal("cli_commands", add_arguments, help="no run")
    assert "meta 'run' is missing: flowrl calls run(args)" in message


def test_cli_command_run_must_be_callable() -> None:
    assert "for meta 'run', 0 is not callable: flowrl calls run(args)" in refusal("cli_commands", add_arguments, run=0)


def test_cli_command_add_arguments_takes_the_parser() -> None:
    message = refusal("cli_commands", lambda: None, run=run_command)
    assert "cannot be called as add_arguments(parser) (too many positional arguments)" in message


@pytest.mark.parametrize("name", CORE_COMMANDS)
def test_cli_command_may_not_shadow_a_core_command(name: str) -> None:
    message = refusal("cli_commands", add_arguments, name=name, run=run_command)
    assert f"'{name}' is a core flowrl command: rename the plugin's command" in message


def test_core_commands_match_the_cli() -> None:
    from flowrl.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(sub.choices) == set(CORE_COMMANDS)  # type: ignore[attr-defined]
