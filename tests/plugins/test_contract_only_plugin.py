"""A generation engine plugin that imports nothing of flowrl but `flowrl.contract`
(tests/plugins/contract_only_engine) is built, samples valid rollouts, and runs `flowrl run` once
registered by name: everything a generation engine needs is public in that one module."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import run_cli

import flowrl.contract
from flowrl.plugins.manager import load_plugins, set_registry

HERE = Path(__file__).parent
PLUGINS = {
    "contract_only_engine": HERE / "contract_only_engine" / "__init__.py",
    "hf_generate": HERE / "hf_generate" / "__init__.py",
}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, PLUGINS[name])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flowrl_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flowrl":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "flowrl"}
    return found


@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_a_generation_engine_plugin_imports_only_the_contract(name):
    assert _flowrl_imports(PLUGINS[name]) == {"flowrl.contract"}


def test_what_a_generation_engine_needs_is_public_in_the_contract():
    needs = {
        "EngineContext", "GenerationEngine", "ShardedGenerationEngine", "DataRank", "EngineCapabilities",
        "Prompt", "Rollout", "Sequences", "Response", "ResponseRules", "to_rollout", "hookimpl", "Register",
        "PluginError", "BackendError", "ModelRun", "SamplingSpec",
    }  # fmt: skip
    assert needs <= set(flowrl.contract.__all__)
    for name in flowrl.contract.__all__:
        assert getattr(flowrl.contract, name) is not None, name


def test_the_plugin_runs_two_steps_of_flowrl_run_chosen_by_name(tmp_path, capsys):
    plugin = _load("contract_only_engine")
    set_registry(load_plugins(entry_points=False, extra=[("contract_loop", plugin)])[1])
    out = tmp_path / "runs"
    sets = ["rollout.prompts_per_step=2", "rollout.max_new_tokens=3", "progress=false", "checkpoint=false"]
    argv = ["run", "grpo", "--steps", "2", "--set", "generation.engine=contract_loop", "--set", f"out={out}"]
    for s in sets:
        argv += ["--set", s]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    steps = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    assert all(s["rollout/tokens"] > 0 for s in steps)
    assert max(s["old_logprobs/logprob_gap"] for s in steps) < 1e-4  # its log-probs are the trainer's


def test_the_plugins_engine_meets_the_protocol_and_samples_with_the_generator_it_is_given(tmp_path):
    from flowrl import api
    from flowrl.contract import EngineContext, GenerationEngine, Prompt

    plugin = _load("contract_only_engine")
    reg = load_plugins(entry_points=False, extra=[("contract_loop", plugin)])[1]
    overrides = ["generation.engine=contract_loop", "rollout.max_new_tokens=4", f"out={tmp_path}"]
    graph, plan = api.plan("grpo", registry=reg, overrides=overrides, emit=lambda s: None)
    ctx = EngineContext(decl=graph.models["actor"], spec=plan.model_run("actor"), device="cpu")
    trainer = reg.get("training_engines", "local")(ctx)
    engine = reg.get("generation_engines", "contract_loop")(EngineContext(**{**ctx.__dict__, "source": trainer}))
    assert isinstance(engine, GenerationEngine)
    prompts = [Prompt(text="ab>", answer="ab"), Prompt(text="cba>", answer="cba")]

    def sample(seed: int):
        return engine.generate(prompts, n=3, greedy=False, generator=torch.Generator().manual_seed(seed))

    first = sample(0)
    assert first.sequences.response_ids.shape[0] == 6 and first.sequences.response_ids.shape[1] <= 4
    assert torch.equal(first.sequences.response_ids, sample(0).sequences.response_ids)


@pytest.mark.slow
def test_an_engine_without_a_temperature_keyword_is_named_when_evaluation_needs_one(tmp_path, capsys):
    """Evaluation at its own temperature passes ``temperature=``; an engine written before that keyword
    is refused by name with what to do, not a TypeError from inside the run."""
    plugin = _load("contract_only_engine")

    class Older(plugin.LoopEngine):
        def generate(self, prompts, *, n, greedy, generator, max_new_tokens=None):  # no temperature
            return super().generate(prompts, n=n, greedy=greedy, generator=generator, max_new_tokens=max_new_tokens)

    class OlderPlugin:
        @staticmethod
        @flowrl.contract.hookimpl
        def register_generation_engines(register):
            register("older_loop", Older, description="a loop engine without the temperature keyword")

    set_registry(load_plugins(entry_points=False, extra=[("older_loop", OlderPlugin)])[1])
    sets = ["rollout.prompts_per_step=2", "rollout.max_new_tokens=2", "progress=false", "checkpoint=false"]
    sets += ["generation.engine=older_loop", "eval.every=1", "eval.temperature=0.5", f"out={tmp_path}"]
    code, _, err = run_cli(capsys, "run", "grpo", "--steps", "1", *[a for s in sets for a in ("--set", s)])
    assert code == 2, err
    assert "model 'actor': eval.temperature 0.5 differs from rollout.temperature" in err
    assert "Older.generate takes no `temperature`" in err
    set_registry(load_plugins(entry_points=False, extra=[("older_loop", OlderPlugin)])[1])
    sets[-2] = "eval.temperature=1.0"  # the run's own: no keyword passed, the older engine evaluates
    code, _, err = run_cli(capsys, "run", "grpo", "--steps", "1", *[a for s in sets for a in ("--set", s)])
    assert code == 0, err
