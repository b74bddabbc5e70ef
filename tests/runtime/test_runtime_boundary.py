"""One plan shape, one runtime boundary: what a user of the CLI and the Python API should get.

Fast by construction: most runs use a fake engine pair registered in-process (the real loss and advantage
functions, no model), a few use the local engines with a tiny config. Tests marked ``xfail(strict=True)``
pin known bugs; each reason names the file at fault.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import yaml

from flowrl import api
from flowrl.cli import main
from flowrl.contract.data import Rollout, Sequences
from flowrl.contract.hardware import save_hardware
from flowrl.contract.plan import ClusterTarget, dump_plan, load_plan
from flowrl.contract.protocols import EngineContext
from flowrl.errors import ConfigError, FlowRLError, GraphError, PlanError, PluginError
from flowrl.graph import Graph
from flowrl.planner.hardware import HARDWARE_PRESETS, parse_cluster
from flowrl.planner.modelspec import load_model_spec
from flowrl.planner.passes import verify_plan
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import Registry, load_plugins, set_registry

TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "progress=false", "checkpoint=false"]
SHIPPED = ("grpo", "ppo", "ppo_rm", "remax", "rloo", "reinforce_pp")


def quiet(_: str) -> None:
    pass


# ---------------------------------------------------------------------------- a fake engine pair


class FakeEngine:
    """Training and generation engine without a model: deterministic rows from the generator; the
    train step runs the registered loss on fake outputs, so losses report their real stats."""

    resumable = False

    def __init__(self, ctx: EngineContext) -> None:
        self.decl = ctx.decl
        self.tokenizer = None
        self.hf_config = None
        self.version = 0
        self.limit = ctx.spec.sampling.max_new_tokens

    def generate(self, prompts, *, n, greedy, generator, max_new_tokens=None) -> Rollout:
        rows = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        b, r = len(rows), self.limit
        lengths = torch.randint(1, r + 1, (b,), generator=generator)
        mask = (torch.arange(r)[None] < lengths[:, None]).float()
        seqs = Sequences(
            prompt_ids=torch.ones(b, 2, dtype=torch.long),
            prompt_mask=torch.ones(b, 2, dtype=torch.long),
            response_ids=torch.randint(3, 20, (b, r), generator=generator) * mask.long(),
            response_mask=mask,
            prompt_index=torch.tensor([i for i, _ in rows], dtype=torch.long),
            texts=tuple(p.answer if j % 2 == 0 else "?" for j, (_, p) in enumerate(rows)),
            version=self.version,
        )
        logprobs = -torch.rand(b, r, generator=generator) * mask
        return Rollout(sequences=seqs, logprobs=logprobs, finished=torch.ones(b, dtype=torch.bool), greedy=greedy)

    def resume(self, rollout, *, generator, max_new_tokens=None) -> Rollout:
        return rollout

    def load_weights(self, weights, version) -> None:
        self.version = version

    def forward(self, seqs, output, micro_batch):
        b = len(seqs)
        if output == "scores":
            return torch.linspace(0.0, 1.0, b)
        level = -0.6 if self.decl.role == "reference" else -0.5 - 0.01 * self.version
        return torch.full(seqs.response_ids.shape, level if output == "logprobs" else 0.1) * seqs.response_mask

    def train(self, loss, batch, step):
        out = self.forward(batch[step.sequences_key], step.output, step.micro_batch).requires_grad_()
        value, stats = loss(out, batch, step.algo)
        self.version += 1
        return {"loss": float(value.detach()), **stats}

    def export_weights(self):
        return {}

    def import_weights(self, weights) -> None:
        pass

    def save_state(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "version").write_text(str(self.version))

    def load_state(self, path: Path) -> int:
        self.version = int((path / "version").read_text())
        return self.version

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)


def plugin(name: str = "fake_engines_plugin", **hooks: Any) -> types.ModuleType:
    """A module plugin implementing ``hooks`` (hook name -> function taking ``register``)."""
    module = types.ModuleType(name)
    for hook, fn in hooks.items():
        setattr(module, hook, hookimpl(fn))
    return module


def fake_engines(register: Any) -> None:
    register("fake", FakeEngine)


def fake_registry(*extra: tuple[str, Any]) -> Registry:
    fake = plugin(register_generation_engines=fake_engines, register_training_engines=fake_engines)
    return load_plugins(entry_points=False, extra=[("fake_engines_plugin", fake), *extra])[1]


FAKE = ["train.engine=fake", "generation.engine=fake"]


def run_fake(source: str, reg: Registry, tmp_path: Path, *extra: str, steps: int = 1):
    graph, plan = api.plan(source, registry=reg, overrides=[*TINY, *FAKE, *extra], flags={"steps": steps}, emit=quiet)
    return api.run(graph, plan, registry=reg, out_dir=tmp_path / source)


@pytest.mark.parametrize("mini_batches", [2, 1])
@pytest.mark.slow
def test_a_plugin_engine_declaring_no_own_outputs_runs_one_or_two_updates_per_batch(tmp_path, mini_batches):
    """An engine written to the TrainingEngine protocol fills no `TrainStep.own`: the planner fuses no
    old-log-prob pass into it (`EngineCapabilities.own_outputs`), even at one update per batch."""
    reg = fake_registry()
    sets = [*TINY, *FAKE, f"train.mini_batches={mini_batches}"]
    graph, plan = api.plan("grpo", registry=reg, overrides=sets, flags={"steps": 1}, emit=quiet)
    assert plan.fused == {}
    assert "train_actor/loss" in api.run(graph, plan, registry=reg, out_dir=tmp_path).metrics[0]


def algorithm(name: str, build: Any) -> types.ModuleType:
    def register_algorithms(register: Any) -> None:
        register(name, build)

    return plugin(f"algo_{name}", register_algorithms=register_algorithms)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr with its line wrapping undone)."""
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, " ".join(out.err.split())


def edited_plan_file(plan, path: Path, **changes: Any) -> Path:
    """``plan`` written to ``path`` with dotted fields changed (None deletes); 'id' dropped to accept the edit."""
    data = msgspec.json.decode(msgspec.json.encode(plan))
    data.pop("id")
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def local_plan(tmp_path_factory):
    """A tiny local plan for grpo (no model built)."""
    set_registry(None)
    out = tmp_path_factory.mktemp("runs")
    return api.plan("grpo", overrides=[*TINY, f"out={out}"], flags={"steps": 1}, emit=quiet)


@pytest.fixture(scope="module")
def cluster16_plan(tmp_path_factory):
    set_registry(None)
    out = tmp_path_factory.mktemp("runs16")
    target = ClusterTarget(cluster=parse_cluster("16xA100-80G"), model=load_model_spec("llama-7b"))
    return api.plan("grpo", overrides=[*TINY, f"out={out}"], target=target, options={"budget_s": 0.5}, emit=quiet)


# ---------------------------------------------------------------------------- choosing engines and executors


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--set", "generation.engine=vllm"], "generation.engine"),
        (["--set", "train.engine=locl"], "train.engine"),
        (["--backend", "ray"], "executor"),
    ],
)
def test_unknown_engine_or_executor_is_exit_2_naming_the_field(capsys, args, field):
    rc, _, err = cli(capsys, "plan", "grpo", *args)
    assert rc == 2
    assert f"config field '{field}'" in err and "Traceback" not in err


def test_unknown_train_engine_suggests_the_close_name(capsys):
    _, _, err = cli(capsys, "plan", "grpo", "--set", "train.engine=locl")
    assert "Did you mean 'local'?" in err


def test_plan_for_backend_on_a_cluster_it_cannot_run_is_refused(capsys):
    rc, _, err = cli(
        capsys, "plan", "grpo", "--cluster", "16xA100-80G", "--model", "llama-7b", "--backend", "local", "--budget", "1"
    )
    assert rc == 2 and "at most 1 device" in err


def test_run_plan_for_16_devices_is_refused_before_any_model_is_built(capsys, tmp_path, cluster16_plan, monkeypatch):
    import flowrl.backends.local.factories as local_engine

    def no_build(ctx):
        raise AssertionError("a model was built")

    monkeypatch.setattr(local_engine, "training_engine", no_build)
    monkeypatch.setattr(local_engine, "generation_engine", no_build)
    _, plan = cluster16_plan
    path = dump_plan(plan, tmp_path / "c16.yaml")
    rc, out, err = cli(capsys, "run", "--plan", str(path))
    assert rc == 2
    assert "a cluster of 16 devices (at most 1)" in err
    assert "running" not in out


def test_plan_out_says_a_16_device_plan_is_a_forecast(capsys, tmp_path):
    path = tmp_path / "p.yaml"
    rc, out, _ = cli(
        capsys, "plan", "grpo", "--cluster", "16xA100-80G", "--model", "llama-7b", "--budget", "0.5", "--out", str(path)
    )
    assert rc == 0 and "a forecast: executor 'local' cannot run it" in out


def test_refusal_under_run_plan_does_not_advise_set(capsys, tmp_path, cluster16_plan):
    _, plan = cluster16_plan
    rc, _, err = cli(capsys, "run", "--plan", str(dump_plan(plan, tmp_path / "c16.yaml")))
    assert rc == 2 and "--set" not in err


def test_a_forecast_for_other_hardware_and_model_is_not_runnable_locally():
    target = ClusterTarget(cluster=parse_cluster("1xA100-80G"), model=load_model_spec("qwen2.5-0.5b"))
    graph, plan = api.plan("grpo", overrides=TINY, target=target, options={"budget_s": 0.5}, emit=quiet)
    assert plan.layout.placement == "colocate" and not any(m.offload_optimizer for m in plan.layout.models)
    with pytest.raises(PlanError, match="qwen2.5-0.5b|A100"):
        api.check(graph, plan)


def test_cluster_local_plans_the_configured_tiny_model(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path))
    save_hardware(HARDWARE_PRESETS["H20"], tmp_path / "hardware" / "local.yaml")
    out = tmp_path / "local.yaml"
    argv = ["plan", "grpo", "--cluster", "local", "--budget", "0.3", "--set", "tiny_model.num_layers=4"]
    rc, _, _ = cli(capsys, *argv, "--out", str(out))
    assert rc == 0
    assert load_plan(out).target.model.layers == 4


def test_local_plan_id_does_not_depend_on_momentary_free_memory(monkeypatch):
    import flowrl.backends.local.device as device

    ids = []
    for extra in (0, 4096):
        monkeypatch.setattr(device, "device_capacity", lambda name, extra=extra: 8 * 1024**3 + extra)
        ids.append(api.plan("grpo", overrides=TINY, emit=quiet)[1].id)
    assert ids[0] == ids[1]


@pytest.mark.parametrize("caps", [{"weight_sync": ("full",)}, {"rollout_modes": ("one_step_off",)}])
def test_a_plan_made_for_an_executor_is_runnable_by_it_or_refused_at_plan_time(caps):
    from flowrl.backends.local.executor import LocalExecutor, machine

    class Narrow(LocalExecutor):
        capabilities = msgspec.structs.replace(LocalExecutor.capabilities, **caps)

    reg = _load_executor(Narrow, machine=machine)
    try:
        graph, plan = api.plan("grpo", registry=reg, overrides=[*TINY, "backend=custom"], emit=quiet)
    except PlanError:
        return
    api.check(graph, plan, registry=reg)


def test_a_json_plan_round_trips(tmp_path, local_plan):
    _, plan = local_plan
    assert load_plan(dump_plan(plan, tmp_path / "plan.json")) == plan


def test_a_plan_for_a_relative_graph_file_runs_from_another_directory(tmp_path, monkeypatch):
    """The graph file is code, so the command line names it (from wherever the user is); the plan's
    fingerprint checks that it is the planned graph."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    _, plan = api.plan("graphs/grpo.py", overrides=TINY, emit=quiet)
    path = dump_plan(plan, tmp_path / "plan.yaml")
    monkeypatch.chdir(tmp_path)
    graph = api.graph_for_plan(load_plan(path), source=str(root / "graphs" / "grpo.py"))
    assert graph.fingerprint() == plan.graph.fingerprint


# ---------------------------------------------------------------------------- hand-edited plan files


@pytest.mark.parametrize(
    ("field", "value", "feature"),
    [
        ("placement", "split", "placement 'split'"),
        ("weight_sync.strategy", "sparse", "weight sync 'sparse'"),
    ],
)
def test_edited_layout_features_are_refused_naming_the_feature(local_plan, field, value, feature):
    graph, plan = local_plan
    layout = msgspec.json.decode(msgspec.json.encode(plan.layout))
    *parents, last = field.split(".")
    node = layout
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[last] = value
    edited = msgspec.structs.replace(plan, layout=msgspec.convert(layout, type(plan.layout)))
    with pytest.raises(PlanError, match=feature):
        api.check(graph, edited)


def test_an_offloaded_optimizer_is_what_the_local_executor_and_engine_declare(local_plan):
    graph, plan = local_plan
    models = tuple(msgspec.structs.replace(m, offload_optimizer=True) for m in plan.layout.models)
    edited = msgspec.structs.replace(plan, layout=msgspec.structs.replace(plan.layout, models=models))
    api.check(graph, edited)  # accepted: the states go to host memory between steps


def test_edited_capabilities_in_the_plan_do_not_widen_what_the_executor_runs(local_plan, cluster16_plan):
    graph, plan = local_plan
    _, big = cluster16_plan
    forged = msgspec.structs.replace(
        big, target=msgspec.structs.replace(big.target, capabilities=plan.target.capabilities)
    )
    with pytest.raises(PlanError, match="16 devices"):
        api.check(graph, forged)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"layout.models.0.parallel.dp": 0}, "layout.models[0].parallel.dp"),
        ({"layout.models.0.micro_batch": 0}, "layout.models[0].micro_batch"),
        ({"layout.groups.0.devices": 2}, "2 devices"),
        ({"nodes.0.micro_batch_size": 0}, "node 'rollout'"),
        ({"nodes.0.group": "nowhere"}, "'nowhere'"),
        ({"memory.0.required_bytes": 10**15}, "per device of group 'all'"),
        ({"graph.fingerprint": "0" * 16}, "Re-run `flowrl plan`"),
        ({"target.workload.mini_batches": 0}, "target.workload.mini_batches"),
        ({"target.cluster.devices_per_node": 16}, "a cluster of 16 devices"),
    ],
)
def test_edited_plan_files_exit_2_naming_the_field(capsys, tmp_path, local_plan, changes, match):
    path = edited_plan_file(local_plan[1], tmp_path / "edited.yaml", **changes)
    rc, _, err = cli(capsys, "run", "--plan", str(path), "--quiet")
    assert rc == 2 and match in err


def test_an_edited_plan_with_its_id_is_refused(tmp_path, local_plan):
    data = msgspec.to_builtins(local_plan[1])
    data["config"]["steps"] = 7
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="edited after it was planned"):
        load_plan(path)


@pytest.mark.parametrize(("field", "value"), [("reserve", 2.0), ("weight_bytes", -4)])
def test_odd_numerics_in_a_plan_file_are_refused(tmp_path, local_plan, field, value):
    path = edited_plan_file(local_plan[1], tmp_path / "p.yaml", **{f"target.numerics.{field}": value})
    with pytest.raises(ConfigError, match=f"target.numerics.{field}"):
        load_plan(path)


def test_a_plan_without_layout_says_the_placement_is_missing(capsys, tmp_path, local_plan):
    path = edited_plan_file(local_plan[1], tmp_path / "p.yaml", layout=None)
    rc, _, err = cli(capsys, "run", "--plan", str(path))
    assert rc == 2 and ("placement" in err or "layout" in err)


def test_unknown_engine_in_a_plan_file_names_the_field(capsys, tmp_path, local_plan):
    path = edited_plan_file(local_plan[1], tmp_path / "p.yaml", **{"config.generation.engine": "nope"})
    rc, _, err = cli(capsys, "run", "--plan", str(path))
    assert rc == 2 and "generation.engine" in err


def test_plan_whose_config_contradicts_its_model_exits_2(capsys, tmp_path, local_plan):
    path = edited_plan_file(local_plan[1], tmp_path / "p.yaml", **{"config.tiny_model.num_heads": 3})
    rc, _, _ = cli(capsys, "run", "--plan", str(path), "--quiet")
    assert rc == 2


# ---------------------------------------------------------------------------- config numerics around the plan


def test_max_new_tokens_zero_names_the_config_field():
    with pytest.raises(FlowRLError, match=r"rollout\.max_new_tokens"):
        api.plan("grpo", overrides=[*TINY, "rollout.max_new_tokens=0"], emit=quiet)


def test_memory_that_does_not_fit_is_refused_with_the_breakdown():
    with pytest.raises(PlanError) as info:
        api.plan("grpo", overrides=[*TINY, "memory_limit_gib=0.001"], emit=quiet)
    assert "group 'all'" in str(info.value) and "Breakdown" in str(info.value)


# ---------------------------------------------------------------------------- graph arity and node options


def _graph(**swap: Any) -> Graph:
    g = Graph("arity")
    g.model("actor", "actor")
    g.model("ref", "reference", init_from="actor")
    nodes = {
        "rollout": lambda: g.generate("rollout", model="actor", n=2),
        "old": lambda: g.forward("old", model="actor", output="logprobs", writes="old_logprobs"),
        "reward": lambda: g.reward("reward", fn="task"),
        "adv": lambda: g.compute("adv", fn="grpo", reads="rewards responses", writes="advantages"),
        "train": lambda: g.train("train", model="actor", loss="ppo", reads="responses old_logprobs advantages"),
    }
    for name, add in nodes.items():
        swap[name](g) if name in swap else add()
    for name, add in swap.items():
        if name not in nodes:
            add(g)
    return g


@pytest.mark.parametrize(
    ("swap", "match"),
    [
        ({"rollout": lambda g: g.generate("rollout", model="actor", reads=())}, "node 'rollout' reads"),
        ({"rollout": lambda g: g.generate("rollout", model="actor", writes="responses a b")}, "node 'rollout' writes"),
        (
            {"old": lambda g: g.forward("old", model="actor", output="logprobs", writes="old_logprobs x")},
            "node 'old' writes",
        ),
        (
            {
                "old": lambda g: g.forward(
                    "old", model="actor", output="logprobs", reads="prompts", writes="old_logprobs"
                )
            },
            "node 'old' reads 0 keys of generated responses",
        ),
        ({"reward": lambda g: g.reward("reward", fn="task", writes="rewards y")}, "node 'reward' writes"),
        ({"reward": lambda g: g.reward("reward", fn="task", reads="responses")}, "node 'reward' reads no prompts"),
        (
            {
                "train": lambda g: g.train(
                    "train", model="actor", loss="ppo", reads="responses old_logprobs advantages", writes="a b"
                )
            },
            "node 'train' writes",
        ),
        (
            {
                "second": lambda g: g.generate("second", model="actor", writes="other"),
                "ref_lp": lambda g: g.forward(
                    "ref_lp", model="ref", output="logprobs", reads="responses other", writes="r"
                ),
            },
            "node 'ref_lp' reads 2 keys",
        ),
    ],
)
def test_arity_rules_name_the_node(swap, match):
    with pytest.raises(GraphError, match=match):
        _graph(**swap).verify()


def test_a_valid_graph_verifies():
    assert _graph().verify()


def _options_graph(options: dict[str, dict[str, Any]]):
    def build(cfg):
        g = Graph("opts")
        g.model("actor", "actor")
        g.generate("rollout", model="actor", n=cfg.rollout.samples_per_prompt, **options.get("rollout", {}))
        g.forward("old", model="actor", output="logprobs", writes="old_logprobs")
        g.reward("reward", fn="task", **options.get("reward", {}))
        g.compute("adv", fn="grpo", reads="rewards responses", writes="advantages", **options.get("adv", {}))
        g.train(
            "train", model="actor", loss="ppo", reads="responses old_logprobs advantages", **options.get("train", {})
        )
        return g

    return build


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"rollout": {"temperature": 0.5}}, "node 'rollout': unknown option"),
        ({"reward": {"bogus": 1}}, "node 'reward': unknown option"),
        ({"train": {"epochs": 0}}, "node 'train': option 'epochs'"),
        ({"train": {"kl_coef": "big"}}, "node 'train'.*kl_coef"),
        ({"adv": {"algo": 1}}, "node 'adv': unknown option"),
    ],
)
def test_wrong_node_options_fail_at_plan_time_naming_node_and_option(options, match):
    reg = load_plugins(entry_points=False, extra=[("opts", algorithm("opts", _options_graph(options)))])[1]
    with pytest.raises(GraphError, match=match):
        api.plan("opts", registry=reg, overrides=TINY, emit=quiet)


def test_a_node_option_of_the_wrong_type_fails_at_plan_time():
    build = _options_graph({"adv": {"eps": "x"}})
    reg = load_plugins(entry_points=False, extra=[("opts", algorithm("opts", build))])[1]
    with pytest.raises(GraphError, match="node 'adv'.*eps"):
        api.plan("opts", registry=reg, overrides=TINY, emit=quiet)


def test_too_many_mini_batches_in_a_node_option_points_at_the_option():
    build = _options_graph({"train": {"mini_batches": 64}})
    reg = load_plugins(entry_points=False, extra=[("opts", algorithm("opts", build))])[1]
    with pytest.raises(PlanError) as info:
        api.plan("opts", registry=reg, overrides=TINY, emit=quiet)
    assert "node 'train'" in str(info.value) and "train.mini_batches" not in str(info.value)


# ---------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.slow
def test_every_shipped_graph_reports_headline_and_node_metrics(tmp_path, name):
    reg = fake_registry()
    result = run_fake(name, reg, tmp_path)
    record = result.metrics[0]
    graph, _ = api.load(name, overrides=TINY, registry=reg)
    for key in ("reward", "kl", "response_length"):
        assert isinstance(record[key], float), (name, key, record.get(key))
    assert record["response_length"] == record["rollout/response_length"]
    assert record["rollout/tokens"] > 0
    assert set(record["spans"]) == set(graph.nodes)
    generated = [n for n, node in graph.nodes.items() if node.kind == "generate"]
    assert record["tokens"] == sum(record[f"{n}/tokens"] for n in generated)
    scorer = "score" if name == "ppo_rm" else "reward"
    assert record["reward"] == record[f"{scorer}/reward"]  # remax: the sampled rows, not the greedy baseline
    assert any(k.startswith("train_actor/") for k in record) and "train_actor/loss" in record
    if name != "ppo_rm":
        assert 0.0 <= record["reward/exact"] <= 1.0
    lines = (result.out_dir / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["reward"] == record["reward"]


def test_a_tensor_metric_from_a_reward_function_is_logged_or_named(tmp_path):
    def bonus_reward(prompts, responses, task):
        return [0.5] * len(responses), {"bonus": torch.tensor(1.0)}

    def register_reward_functions(register):
        register("bonus", bonus_reward)

    def build(cfg):
        g = Graph("bonus")
        g.model("actor", "actor")
        g.generate("rollout", model="actor", n=cfg.rollout.samples_per_prompt)
        g.forward("old", model="actor", output="logprobs", writes="old_logprobs")
        g.reward("reward", fn="bonus")
        g.compute("adv", fn="grpo", reads="rewards responses", writes="advantages")
        g.train("train", model="actor", loss="ppo", reads="responses old_logprobs advantages")
        return g

    reg = fake_registry(
        ("bonus_plugin", plugin("bonus_plugin", register_reward_functions=register_reward_functions)),
        ("bonus_algo", algorithm("bonus", build)),
    )
    try:
        result = run_fake("bonus", reg, tmp_path)
    except FlowRLError as exc:
        assert "reward" in str(exc) and "bonus" in str(exc)
    else:
        assert result.metrics[0]["reward/bonus"] == 1.0


def test_a_compute_node_reading_two_response_keys_is_named(tmp_path):
    def build(cfg):
        g = Graph("two")
        g.model("actor", "actor")
        g.generate("rollout", model="actor", n=cfg.rollout.samples_per_prompt)
        g.generate("second", model="actor", writes="other", n=cfg.rollout.samples_per_prompt)
        g.forward("old", model="actor", output="logprobs", writes="old_logprobs")
        g.reward("reward", fn="task")
        g.compute("adv", fn="grpo", reads="rewards responses other", writes="advantages")
        g.train("train", model="actor", loss="ppo", reads="responses old_logprobs advantages")
        return g

    reg = fake_registry(("two", algorithm("two", build)))
    with pytest.raises(GraphError, match="node 'adv'"):
        run_fake("two", reg, tmp_path)


# ---------------------------------------------------------------------------- plan file vs direct run (CLI)


def _records(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        for key in ("tokens_per_s", "step_seconds", "spans"):
            row.pop(key)
    return rows


@pytest.mark.slow
def test_plan_out_then_run_plan_equals_run(capsys, tmp_path):
    set_registry(fake_registry())
    sets = [a for s in [*TINY, *FAKE, f"out={tmp_path}"] for a in ("--set", s)]
    plan_file = tmp_path / "plan.yaml"
    assert cli(capsys, "plan", "ppo", "--steps", "2", *sets, "--name", "planned", "--out", str(plan_file))[0] == 0
    assert cli(capsys, "run", "--plan", str(plan_file))[0] == 0
    assert cli(capsys, "run", "ppo", "--steps", "2", *sets, "--name", "direct")[0] == 0
    planned, direct = _records(tmp_path / "planned" / "metrics.jsonl"), _records(tmp_path / "direct" / "metrics.jsonl")
    assert len(planned) == 2 and planned == direct
    assert (tmp_path / "planned" / "plan.yaml").read_bytes() == plan_file.read_bytes()


# ---------------------------------------------------------------------------- broken plugins


def _load_executor(obj: Any, **meta: Any) -> Registry:
    def register_executors(register):
        register("custom", obj, **meta)

    return load_plugins(entry_points=False, extra=[("exec_plugin", plugin(register_executors=register_executors))])[1]


def test_an_executor_factory_function_is_refused_or_works(capsys):
    from flowrl.backends.local.executor import LocalExecutor, machine

    try:
        reg = _load_executor(lambda registry: LocalExecutor(registry), machine=machine)
    except PluginError as exc:
        assert "exec_plugin" in str(exc)
        return
    set_registry(reg)
    assert cli(capsys, "plan", "grpo", "--backend", "custom")[0] in (0, 2)


def test_an_executor_with_bad_capabilities_is_refused_at_load():
    from flowrl.backends.local.executor import LocalExecutor, machine

    class BadCaps(LocalExecutor):
        capabilities = {"max_devices": 1}

    with pytest.raises(PluginError, match="exec_plugin"):
        _load_executor(BadCaps, machine=machine)


def test_a_bad_machine_names_the_executor_or_plugin():
    from flowrl.backends.local.executor import LocalExecutor

    reg = _load_executor(LocalExecutor, machine=lambda cfg: "H20")
    with pytest.raises(FlowRLError, match="custom|exec_plugin"):
        api.plan("grpo", registry=reg, overrides=[*TINY, "backend=custom"], emit=quiet)


def test_an_engine_factory_returning_none_is_named(tmp_path):
    def register_generation_engines(register):
        register("none", lambda ctx: None)

    reg = fake_registry(("none_plugin", plugin(register_generation_engines=register_generation_engines)))
    graph, plan = api.plan(
        "grpo", registry=reg, overrides=[*TINY, "train.engine=fake", "generation.engine=none"], emit=quiet
    )
    with pytest.raises(FlowRLError, match="none"):
        api.run(graph, plan, registry=reg, out_dir=tmp_path / "run")


@pytest.mark.slow
def test_a_generation_factory_registered_under_the_train_engines_name_is_used(tmp_path):
    class TrainOnly(FakeEngine):
        generate = None  # type: ignore[assignment]

    calls = []

    def generation_factory(ctx):
        calls.append(ctx.decl.name)
        return FakeEngine(ctx)

    pair = plugin(
        register_training_engines=lambda register: register("pair", TrainOnly),
        register_generation_engines=lambda register: register("pair", generation_factory),
    )
    reg = load_plugins(entry_points=False, extra=[("pair", pair)])[1]
    overrides = [*TINY, "train.engine=pair", "generation.engine=pair"]
    graph, plan = api.plan("grpo", registry=reg, overrides=overrides, emit=quiet)
    api.run(graph, plan, registry=reg, out_dir=tmp_path / "run")
    assert calls == ["actor"]


def test_a_raising_engine_hook_names_the_plugin():
    def register_generation_engines(register):
        raise ValueError("oops")

    with pytest.raises(PluginError, match="plugin 'boom' failed in hook register_generation_engines"):
        load_plugins(
            entry_points=False, extra=[("boom", plugin(register_generation_engines=register_generation_engines))]
        )


def test_an_engine_factory_with_the_wrong_signature_is_refused_at_load():
    class NoCtx:
        def __init__(self) -> None:
            pass

    with pytest.raises(PluginError, match="plugin 'sig' registered training engine 'x'"):
        load_plugins(
            entry_points=False, extra=[("sig", plugin(register_training_engines=lambda register: register("x", NoCtx)))]
        )


# ---------------------------------------------------------------------------- the local engines


@pytest.fixture(scope="module")
def local_actor():
    set_registry(None)
    graph, plan = api.plan("grpo", overrides=[*TINY, "task=repeat", "rollout.max_new_tokens=8"], emit=quiet)
    reg = load_plugins(entry_points=False)[1]
    return reg.get("training_engines", "local")(
        EngineContext(decl=graph.models["actor"], spec=plan.model_run("actor"), device="cpu")
    )


@pytest.mark.slow
def test_local_engine_resumes_unfinished_rows_to_the_same_result(local_actor):
    from flowrl.contract.data import Prompt

    prompts = [Prompt(text="ab>", answer="ab"), Prompt(text="dcba>", answer="dcba")]

    def gen():
        return torch.Generator().manual_seed(0)

    full = local_actor.generate(prompts, n=2, greedy=True, generator=gen())
    part = local_actor.generate(prompts, n=2, greedy=True, generator=gen(), max_new_tokens=1)
    assert local_actor.resumable and part.sequences.response_ids.shape[1] == 1
    steps = 0
    while not bool(part.finished.all()):
        part = local_actor.resume(part, generator=gen(), max_new_tokens=1)
        steps += 1
        assert steps <= 8
    assert torch.equal(part.sequences.response_ids, full.sequences.response_ids)
    assert torch.equal(part.sequences.response_mask, full.sequences.response_mask)
    assert part.sequences.texts == full.sequences.texts
    mask = part.sequences.response_mask.bool()
    assert torch.allclose(part.logprobs[mask], full.logprobs[mask], atol=1e-5)
    forward = local_actor.forward(part.sequences, "logprobs", 2)
    assert torch.allclose(forward[mask], part.logprobs[mask], atol=1e-4)
    again = local_actor.resume(full, generator=gen())  # nothing left to resume
    assert torch.equal(again.sequences.response_ids, full.sequences.response_ids) and bool(again.finished.all())


@pytest.mark.slow
def test_a_separate_local_generation_engine_tracks_the_trained_weights(tmp_path):
    from flowrl.plugins.builtin import _local_generation_engine

    copy = plugin(register_generation_engines=lambda register: register("local_copy", _local_generation_engine))
    reg = load_plugins(entry_points=False, extra=[("copy", copy)])[1]
    records = {}
    for engine in ("local", "local_copy"):
        overrides = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "checkpoint=false"]
        graph, plan = api.plan(
            "grpo", registry=reg, overrides=[*overrides, f"generation.engine={engine}"], flags={"steps": 2}, emit=quiet
        )
        result = api.run(graph, plan, registry=reg, out_dir=tmp_path / engine)
        timing = ("tokens_per_s", "step_seconds", "spans")
        # a separate generation engine adds the weight-sync task's own metrics (sync:<train node>/...)
        records[engine] = [
            {k: v for k, v in r.items() if k not in timing and not k.startswith("sync:")} for r in result.metrics
        ]
    # the same samples, rewards and updates; the sampler-vs-trainer log-prob gap itself is float noise
    # (6e-8 vs 7e-8 at step 1), which the two engines' separate modules need not reproduce bit for bit
    gaps = {e: [r.pop(k) for r in rows for k in list(r) if "logprob_gap" in k] for e, rows in records.items()}
    assert records["local"] == records["local_copy"]
    assert all(g < 1e-5 for g in gaps["local"] + gaps["local_copy"])


# ---------------------------------------------------------------------------- layering


def test_the_runtime_boundary_and_capabilities_import_no_torch_or_backend():
    code = (
        "import sys\n"
        "import flowrl.contract, flowrl.planner.memory, flowrl.planner.passes\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('flowrl.backends', 'transformers'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_edited_plan_verifies_the_same_as_planned(local_plan):
    graph, plan = local_plan
    verify_plan(graph, plan)
    assert plan.passes == ("resolve", "place", "micro_batch", "memory")
    assert plan.target.capabilities is not None and plan.target.capabilities.max_devices == 1
