"""Plans users can trust (issue 12), as a new ML engineer tries the cluster
planner: `flowrl plan --require` constraints and `--explain`'s constrained-vs-unconstrained
comparison, per-role models (`--model actor=llama-34b,reward=llama-7b` and per-role YAML files),
generation with continuous batching and offload, the fitted efficiency curve and its cluster-file
override, the wider placement space, bad inputs, `--budget`, and plan files (written, read back,
re-planned, refused by `flowrl run --plan` when they are forecasts).

Tests of what works keep it working; each known bug is a test marked
``xfail(strict=True)`` that fails while the bug is there. Where a result depends on how many
candidates the search simulates within ``--budget``, the tuner's clock is replaced: ``frozen``
never runs out (the whole space is searched, the same on every machine) and ``slow`` runs out
after the first candidate (a short budget on a busy machine), so every test is deterministic.
Plans are for small clusters with ``--budget 1``: the module runs in well under a minute.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flowrl import api
from flowrl.cli import main
from flowrl.contract.layout import ClusterPlan
from flowrl.contract.plan import ExecutionPlan, dump_plan, encode_plan, load_plan
from flowrl.planner import autotune
from flowrl.planner.autotune import Tuner
from flowrl.planner.cost import CostModel
from flowrl.planner.hardware import HARDWARE_PRESETS, parse_cluster
from flowrl.planner.memory import Numerics
from flowrl.planner.modelspec import MODEL_PRESETS
from flowrl.planner.simulate import Generator
from flowrl.planner.space import (
    DeviceGroup,
    GenerationLayout,
    ModelLayout,
    Parallel,
    RolloutPolicy,
    WeightSync,
    layouts,
    skeletons,
)
from flowrl.planner.workload import WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "graphs"
PPO_RM = str(GRAPHS / "ppo_rm.py")
TWO_AGENT = str(GRAPHS / "two_agent.py")
DAPO = str(GRAPHS / "dapo.py")
SAFE = str(GRAPHS / "safe_rlhf.py")
H100 = ("--cluster", "8xH100-80G", "--budget", "1")
HEAVY = ("torch", "transformers", "vllm", "ray")


# ------------------------------------------------------------------ helpers


class _Frozen:
    """A search clock that never runs out: the tuner simulates every candidate."""

    @staticmethod
    def perf_counter() -> float:
        return 0.0


class _Slow:
    """A search clock that runs out after the first candidate (a short --budget on a busy machine)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 100.0
        return self.now


@pytest.fixture
def frozen(monkeypatch):
    monkeypatch.setattr(autotune, "time", _Frozen)


@pytest.fixture
def slow(monkeypatch):
    monkeypatch.setattr(autotune, "time", _Slow())


def words(text: str) -> list[str]:
    return text.split()


def require(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--require", item)]


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``flowrl ARGV`` in this process: (exit status, stdout, stderr with its line wrapping undone)."""
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, " ".join(out.err.split())


def plan_to(capsys, path: Path, *argv: str) -> ExecutionPlan:
    """``flowrl plan ARGV --out PATH``, which must succeed; the plan read back."""
    rc, _, err = cli(capsys, "plan", *argv, "--out", str(path), "--force")
    assert rc == 0, err
    return load_plan(path)


def fails(capsys, *argv: str) -> str:
    """``flowrl plan ARGV``, which must exit 2 with one paragraph and no traceback; that paragraph."""
    rc, _, err = cli(capsys, "plan", *argv)
    assert rc == 2, err
    assert err.startswith("flowrl: error:") and "Traceback" not in err
    return err


def fits(plan: ExecutionPlan) -> None:
    """Every device group of ``plan`` fits its devices, and --explain's memory is the plan's."""
    for est in plan.memory:
        assert 0 < est.required_bytes <= est.capacity_bytes, est
        assert plan.layout.predicted.memory_bytes[est.group] == est.required_bytes


def seconds(plan: ExecutionPlan) -> float:
    return plan.layout.predicted.iteration_s


def shapes(plan: ExecutionPlan) -> dict[str, str]:
    return {m: s.name for m, s in plan.target.models.items()}


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ per-role models: what works


@pytest.mark.slow
def test_a_per_role_plan_records_each_shape_round_trips_and_has_a_stable_id(tmp_path, capsys, frozen):
    argv = [PPO_RM, *H100, "--model", "actor=llama-13b,reward=qwen2.5-0.5b"]
    argv += require("placement=colocate", "rollout.mode=sync")
    first = plan_to(capsys, tmp_path / "a.yaml", *argv)
    # the reference follows the actor, the critic the reward model; the base model is the actor's
    assert shapes(first) == {"actor": "llama-13b", "critic": "qwen2.5-0.5b", "ref": "llama-13b", "rm": "qwen2.5-0.5b"}
    assert first.target.model == MODEL_PRESETS["llama-13b"]
    assert first.target.models["rm"] == MODEL_PRESETS["qwen2.5-0.5b"]  # the whole shape, not just its name
    fits(first)
    # the same inputs give the same plan and id; YAML and JSON round trips keep both
    again = plan_to(capsys, tmp_path / "b.json", *argv)
    assert again.id == first.id and again == first
    copy = load_plan(dump_plan(load_plan(tmp_path / "a.yaml"), tmp_path / "copy.yaml"))
    assert copy == first and encode_plan(copy) == encode_plan(first)
    # re-planned with the plan file as the workload: the same plan
    replanned = plan_to(capsys, tmp_path / "c.yaml", *argv, "--workload", str(tmp_path / "a.yaml"))
    assert replanned.target.workload == first.target.workload and replanned.id == first.id


def test_explain_names_every_models_shape(capsys):
    rc, out, err = cli(capsys, "plan", SAFE, *H100, "--model", "actor=llama-7b,critic=qwen2.5-0.5b", "--explain")
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("models: "))
    assert "actor=llama-7b (6.7B)" in line and "ref=llama-7b (6.7B)" in line
    assert "reward_critic=qwen2.5-0.5b (0.5B)" in line and "cost_critic=qwen2.5-0.5b (0.5B)" in line


def test_a_smaller_reward_model_makes_the_same_layout_faster_and_lighter(tmp_path, capsys, frozen):
    same = require("placement=colocate", "rollout.mode=sync", "critic.tp=1", "critic.pp=1", "rm.tp=1", "rm.pp=1")
    big, small = (
        plan_to(capsys, tmp_path / f"{i}.yaml", PPO_RM, *H100, "--model", model, *same)
        for i, model in enumerate(["actor=llama-13b,reward=llama-7b", "actor=llama-13b,reward=qwen2.5-1.5b"])
    )
    fits(big)
    fits(small)
    assert seconds(small) < seconds(big)
    assert small.memory[0].required_bytes < big.memory[0].required_bytes
    for node in ("score", "values", "train_critic"):
        assert small.layout.predicted.breakdown[node] < big.layout.predicted.breakdown[node]


@pytest.mark.slow
def test_more_gpus_are_not_predicted_slower_when_the_whole_space_is_searched(tmp_path, capsys, frozen):
    one = plan_to(capsys, tmp_path / "8.yaml", *words("grpo --cluster 8xA100-80G --model llama-7b --budget 1"))
    two = plan_to(capsys, tmp_path / "16.yaml", *words("grpo --cluster 2x8xA100-80G --model llama-7b --budget 1"))
    fits(one)
    fits(two)
    assert seconds(two) < 0.7 * seconds(one)


@pytest.mark.slow
def test_a_per_role_yaml_file_resolves_relative_paths_from_its_own_folder(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "models"
    (folder / "rm").mkdir(parents=True)
    config = dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8)
    config.update(model_type="llama", intermediate_size=5632, vocab_size=32000)
    write(folder / "rm" / "config.json", json.dumps(config))
    s = MODEL_PRESETS["llama-7b"]
    fields = f"hidden: {s.hidden}\nheads: {s.heads}\nkv_heads: {s.kv_heads}\nintermediate: {s.intermediate}\n"
    write(folder / "critic.yaml", f"name: half-7b\nlayers: 16\n{fields}vocab: {s.vocab}\n")
    write(folder / "roles.yaml", "default: llama-7b\nreward: rm/config.json\ncritic: critic.yaml\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # relative to the YAML file, not to where flowrl runs
    p = plan_to(capsys, tmp_path / "plan.yaml", PPO_RM, *H100, "--model", "../models/roles.yaml")
    assert shapes(p) == {"actor": "llama-7b", "critic": "half-7b", "ref": "llama-7b", "rm": "rm"}
    assert p.target.models["rm"].layers == 16 and p.target.models["critic"].layers == 16
    fits(p)


SPEC = "{name: rm, layers: 2, hidden: 64, heads: 2, kv_heads: 2, intermediate: 64, vocab: 99"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"actor: llama-7b\nreward: {SPEC.replace('layers: 2', 'layers: 0')}}}\n", "entry 'reward': field 'layers'"),
        ("actor: llama-7b\nreward: 7\n", "entry 'reward': give a preset name, a config path or ModelSpec fields"),
        ("actor: llama-7b\nreward: nowhere/config.json\n", "entry 'reward': model 'nowhere/config.json'"),
        (f"actor: llama-7b\nreward: {SPEC}, bogus: 1}}\n", "entry 'reward': unknown field 'bogus'"),
        ("actor: llama-7b\nactor: llama-13b\n", "models.yaml"),
        ("actor: [llama-7b\n", "is not valid YAML"),
    ],
    ids=["bad-field", "not-a-model", "missing-path", "unknown-field", "duplicate-key", "bad-yaml"],
)
def test_a_bad_per_role_yaml_file_names_the_file_and_the_entry(tmp_path, capsys, text, message):
    path = write(tmp_path / "models.yaml", text)
    err = fails(capsys, PPO_RM, *H100, "--model", path)
    assert message in err and path in err


@pytest.mark.parametrize(
    ("graph", "model", "message"),
    [
        ("grpo", "actor=llama-7b,reward=llama-7b", "'reward', which is neither a model of this graph (actor, ref)"),
        ("ppo", "actor=llama-7b,reward=llama-7b", "'reward', which is neither a model of this graph (actor, critic"),
        (PPO_RM, "actor=llama-7b,actor=llama-13b", "names role 'actor' twice"),
        (PPO_RM, "actor=llama-7b,judge=llama-7b", "'judge', which is neither a model of this graph"),
        (PPO_RM, "actor=llama-7b,reward=llama-8", "entry 'reward=llama-8'"),
        (PPO_RM, "llama-7b,llama-13b,reward=llama-7b", "names two default models"),
    ],
    ids=["grpo-reward", "ppo-reward", "duplicate", "unknown-role", "unknown-preset", "two-defaults"],
)
def test_bad_per_role_keys_are_named(capsys, graph, model, message):
    assert message in fails(capsys, graph, *H100, "--model", model)


def test_a_model_too_big_for_the_cluster_says_how_many_devices_it_needs(capsys):
    err = fails(capsys, PPO_RM, "--cluster", "1xA100-80G", "--model", "actor=llama-70b,reward=qwen2.5-1.5b")
    assert "actor=llama-70b (69.0B), critic=qwen2.5-1.5b (1.5B)" in err
    assert "at least 17 of these devices" in err and "try --cluster 32xA100-80G" in err


# ------------------------------------------------------------------ constraints: what works


@pytest.mark.parametrize(
    ("graph", "item", "message"),
    [
        ("grpo", "rollout.mode=turbo", "'rollout.mode': unknown part 'turbo'"),
        (DAPO, "rollout.mode=async", "filter 'dynamic_sampling' samples rounds"),
        (TWO_AGENT, "rollout.mode=partial+async", "graph 'two_agent' has 2 (propose, solve)"),
        ("grpo", "placement=split", "no plan for this graph on this cluster has placement 'split'"),
        ("grpo", "generation.tp=16", "has generation tp 16 (required); there are: 1, 2, 4, 8"),
        (PPO_RM, "reward.tp=2", "the graph has no model 'reward'"),
    ],
)
def test_impossible_requirements_are_named(capsys, graph, item, message):
    assert message in fails(capsys, graph, *H100, "--model", "llama-7b", *require(item))


def test_required_layouts_hold_for_per_role_models(tmp_path, capsys):
    argv = [PPO_RM, *H100, "--model", "actor=llama-13b,reward=qwen2.5-1.5b"]
    p = plan_to(capsys, tmp_path / "plan.yaml", *argv, *require("critic.tp=4", "rm.dp=8", "sync=reshard"))
    assert p.layout.layout("critic").parallel.tp == 4 and p.layout.layout("rm").parallel.dp == 8
    assert p.layout.weight_sync.strategy == "reshard"
    fits(p)


# ------------------------------------------------------------------ plan files, forecasts, efficiency, inputs


def test_a_forecast_plan_is_refused_by_run_before_anything_is_built(tmp_path, capsys, slow):
    path = str(tmp_path / "plan.yaml")
    rc, out, _ = cli(capsys, "plan", PPO_RM, *H100, "--model", "actor=llama-7b,reward=qwen2.5-0.5b", "--out", path)
    assert rc == 0 and "(a forecast: executor 'local' cannot run it)" in out
    rc, _, err = cli(capsys, "run", PPO_RM, "--plan", path)
    assert rc == 2 and "executor 'local' cannot run this plan" in err and "a cluster of 8 devices (at most 1)" in err
    assert "Traceback" not in err
    rc, _, err = cli(capsys, "run", "--plan", path)  # a plan naming a graph file runs only if you name it too
    assert rc == 2 and f"flowrl run {PPO_RM} --plan" in err


def test_a_cluster_files_efficiency_curve_and_engine_load_change_the_prediction(tmp_path, capsys):
    same = ["--model", "llama-7b", "--budget", "1"]
    same += require("placement=colocate", "rollout.mode=sync", "actor.dp=8", "ref.dp=8", "generation.tp=2")
    base = plan_to(capsys, tmp_path / "base.yaml", "grpo", "--cluster", "8xH100-80G", *same)
    curve = "{e_max: 0.3, k_w: 1.5, k_a: 4.5, e_attn: 0.15, ridge: 295}"
    text = f"nodes: 1\nhardware:\n  preset: H100-80G\n  engine_tensor_overhead: 0\n  efficiency: {curve}\n"
    mine = plan_to(capsys, tmp_path / "mine.yaml", "grpo", "--cluster", write(tmp_path / "c.yaml", text), *same)
    b, m = base.layout.predicted.breakdown, mine.layout.predicted.breakdown
    assert m["train_actor"] > 1.5 * b["train_actor"]  # half the ceiling: much slower training
    assert m["weight_sync"] < 0.6 * b["weight_sync"]  # no per-tensor engine load
    bad = write(tmp_path / "bad.yaml", text.replace("e_max: 0.3", "e_max: 1.5"))
    err = fails(capsys, "grpo", "--cluster", bad, "--model", "llama-7b")
    assert "field 'hardware.efficiency.e_max': Expected `float` <= 1.0" in err


def test_extreme_workloads_plan_or_say_what_to_shrink(tmp_path, capsys):
    one = "prompts_per_step: 1\nsamples_per_prompt: 1\nprompt_length: 1\nresponse_length: 1\n"
    tiny = write(tmp_path / "tiny.yaml", one)
    p = plan_to(capsys, tmp_path / "plan.yaml", "grpo", *H100, "--model", "llama-7b", "--workload", tiny)
    fits(p)
    assert 0 < seconds(p) < 10
    huge = "prompts_per_step: 8\nsamples_per_prompt: 1\nprompt_length: 1000000\nresponse_length: 1000000\n"
    err = fails(capsys, "grpo", *H100, "--model", "llama-7b", "--workload", write(tmp_path / "huge.yaml", huge))
    assert "use shorter prompts/responses" in err


def probe(*commands: list[str]) -> dict:
    """Run each ``flowrl`` command in one fresh interpreter: their exit codes and the heavy modules they loaded."""
    code = (
        "import json, sys\nfrom flowrl.cli import main\n"
        f"codes = [main(argv) for argv in {list(commands)!r}]\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(json.dumps({'codes': codes, 'heavy': heavy}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_error_exits_of_cluster_plans_load_no_torch(tmp_path):
    bad = write(tmp_path / "models.yaml", "actor: llama-7b\nreward: 7\n")
    result = probe(
        ["plan", PPO_RM, *H100, "--model", "actor=llama-7b,judge=llama-7b"],
        ["plan", PPO_RM, *H100, "--model", bad],
        ["plan", PPO_RM, *H100, "--model", "llama-7b", "--require", "rm.tp=zero"],
        ["plan", "grpo", *H100, "--model", "llama-7b", "--require", "generation.tp=16"],
    )
    assert result == {"codes": [2, 2, 2, 2], "heavy": []}


def test_a_second_policy_gets_its_own_shape_and_generation_layout(tmp_path, capsys, slow):
    p = plan_to(capsys, tmp_path / "plan.yaml", TWO_AGENT, *H100, "--model", "llama-7b,solver=qwen2.5-0.5b")
    assert shapes(p) == {"proposer": "llama-7b", "solver": "qwen2.5-0.5b"}
    assert [g.model for g in p.layout.generations] == ["solver"]
    fits(p)


def test_the_placement_space_has_odd_groups_deep_pipelines_and_a_generation_group_beside_each_model():
    roles = autotune.roles_of(api.load("grpo")[0])
    found = {(sk.placement, tuple((g.name, g.devices) for g in sk.groups)) for sk in skeletons(roles, 24, 8, 32, 32)}
    assert ("disaggregated", (("gen", 8), ("actor", 8), ("ref", 8))) in found  # a generation group beside each model
    assert ("disaggregated", (("gen", 8), ("train", 16))) in found  # whole-node multiples
    found = {(sk.placement, tuple((g.name, g.devices) for g in sk.groups)) for sk in skeletons(roles, 6, 6, 40, 40)}
    assert ("disaggregated", (("gen", 1), ("train", 5))) in found  # any in-node group size
    options = layouts(
        "actor",
        DeviceGroup(name="train", devices=5, first=1),
        trainable=True,
        per_node=6,
        heads=40,
        kv_heads=40,
        layers=40,
        batch=1024,
    )
    assert {lay.parallel.pp for lay in options} == {5}  # pp any divisor of the layers (40 / 5)


def test_generation_offloads_crowding_states_and_batches_continuously():
    model, hw, w = MODEL_PRESETS["llama-7b"], HARDWARE_PRESETS["H100-80G"], WorkloadSpec()
    group = DeviceGroup(name="all", devices=8, first=0)
    plan = ClusterPlan(
        placement="colocate",
        groups=(group,),
        models=(),
        rollout=RolloutPolicy(),
        generation=GenerationLayout(group="all", tp=1, replicas=8),
        weight_sync=WeightSync(strategy="reshard"),
    )

    def rollout(static: int, numerics: Numerics) -> tuple[float, Generator]:
        gen = Generator(plan, CostModel(model, hw), w, static, np.random.default_rng(0), numerics=numerics)
        return gen.iteration(w.sequences)[0], gen

    free, _ = rollout(0, Numerics())
    crowded, gen = rollout(40 * 2**30, Numerics())
    assert gen.offloaded == 40 * 2**30 and crowded == pytest.approx(free)  # the states leave; the KV cache stays
    kept, gen = rollout(40 * 2**30, Numerics(offload_for_rollout=False))
    assert gen.offloaded == 0 and kept > free
    narrow, _ = rollout(0, Numerics(decode_batch=32))
    assert narrow > free  # fewer sequences decoding at once: more decode steps


# ------------------------------------------------------------------ bugs


def test_a_requirement_no_layout_admits_is_named_not_blamed_on_memory(capsys):
    model = ("--model", "actor=llama-34b,reward=qwen2.5-1.5b")
    err = fails(capsys, PPO_RM, "--cluster", "2x8xH100-80G", "--budget", "1", *model, *require("critic.tp=8"))
    assert "critic.tp=8" in err and "activations or the KV cache" not in err


def test_a_cluster_no_layout_divides_is_not_blamed_on_memory(capsys):
    err = fails(capsys, DAPO, *words("--cluster 2x6xH20 --model qwen2.5-7b --budget 1"))
    assert "activations or the KV cache" not in err


@pytest.mark.slow
def test_per_role_models_may_name_each_policy_by_its_model_name(tmp_path, capsys, slow):
    p = plan_to(capsys, tmp_path / "plan.yaml", TWO_AGENT, *H100, "--model", "proposer=llama-7b,solver=qwen2.5-0.5b")
    assert shapes(p) == {"proposer": "llama-7b", "solver": "qwen2.5-0.5b"}


def test_every_generation_layout_divides_its_own_models_heads(tmp_path, capsys, slow):
    path = str(tmp_path / "plan.yaml")
    argv = [TWO_AGENT, *H100, "--model", "llama-7b,solver=qwen2.5-1.5b", *require("generation.tp=8")]
    rc, _, err = cli(capsys, "plan", *argv, "--out", path)
    if rc == 0:
        p = load_plan(path)
        for gen in (p.layout.generation, *p.layout.generations):
            heads = p.target.spec(gen.model or "proposer").heads
            assert heads % gen.tp == 0, f"{gen.model or 'proposer'}: {heads} heads on tp {gen.tp}"
    else:
        assert "solver" in err and "12" in err


def test_a_larger_second_policy_gets_a_plan_that_fits(tmp_path, capsys, slow):
    fits(plan_to(capsys, tmp_path / "plan.yaml", TWO_AGENT, *H100, "--model", "qwen2.5-0.5b,solver=llama-34b"))


def test_a_pinned_placement_that_contradicts_a_requirement_is_refused(capsys):
    argv = ["grpo", *H100, "--model", "llama-7b", "--placement", "colocate", *require("placement=disaggregated")]
    rc, out, err = cli(capsys, "plan", *argv, "--explain")
    if rc == 0:  # "winner: 98.44 s/iteration  colocate [all:8] ..."
        assert out.split("winner: ")[1].split()[2] == "disaggregated"
    else:
        assert "placement" in err


def test_a_key_required_twice_is_refused(capsys):
    assert "actor.tp" in fails(capsys, "grpo", *H100, "--model", "llama-7b", *require("actor.tp=2", "actor.tp=4"))


@pytest.mark.slow
def test_the_unconstrained_winner_is_never_slower_than_the_constrained_plan(capsys, slow):
    argv = [PPO_RM, "--cluster", "3x8xH100-80G", "--budget", "1", "--model", "actor=llama-34b,reward=llama-7b"]
    argv += require("placement=disaggregated", "rollout.mode=one_step_off", "generation.tp=8", "sync=sparse")
    rc, out, err = cli(capsys, "plan", *argv, "--explain")
    assert rc == 0, err
    cost = float(re.search(r"the constraints cost ([+-][\d.]+) s/iteration", out).group(1))
    assert cost >= 0, out


def test_a_short_budget_does_not_make_more_gpus_predicted_much_slower(tmp_path, capsys, slow):
    four = plan_to(capsys, tmp_path / "4.yaml", *words("grpo --cluster 4xA100-80G --model llama-13b --budget 1"))
    six = plan_to(capsys, tmp_path / "6.yaml", *words("grpo --cluster 6xA100-80G --model llama-13b --budget 1"))
    assert seconds(six) <= 1.1 * seconds(four)


@pytest.mark.slow
def test_the_budget_holds_for_a_large_workload(tmp_path, capsys):
    """The search stops at its budget on a large workload. The clock is tests/conftest.py's PlannerClock
    (a read per candidate), so this holds on any machine; the wall-clock time is benchmarks/planner.py's."""
    lengths = "response_length: {kind: lognormal, median: 1000, sigma: 1.0, max: 16384}\n"
    workload = write(tmp_path / "big.yaml", f"prompts_per_step: 1024\nsamples_per_prompt: 16\n{lengths}")
    argv = ["grpo", "--cluster", "8xH100-80G", "--model", "llama-7b", "--workload", workload, "--budget", "0.25"]
    rc, out, err = cli(capsys, "plan", *argv, "--explain")
    assert rc == 0, err
    searched = float(re.search(r"feasible plans in ([\d.]+)s", out).group(1))
    assert searched <= 1.0, out.splitlines()[0]


def test_a_huge_lognormal_sigma_is_planned_or_named(tmp_path, capsys):
    lengths = "response_length: {kind: lognormal, median: 512, sigma: 50, max: 8192}\n"
    workload = write(tmp_path / "w.yaml", f"prompts_per_step: 16\nsamples_per_prompt: 4\n{lengths}")
    rc, _, err = cli(capsys, "plan", "grpo", *H100, "--model", "llama-7b", "--workload", workload)
    assert rc == 0 or ("sigma" in err and "crashed" not in err), err


def test_a_configured_micro_batch_is_the_one_the_prediction_costs(tmp_path, capsys, slow):
    argv = ["grpo", *H100, "--model", "llama-7b", "--set", "train.micro_batch_size=1"]
    p = plan_to(capsys, tmp_path / "plan.yaml", *argv)
    assert p.node("train_actor").micro_batch_size == 1
    assert p.layout.layout("actor").micro_batch == 1


def test_a_scalar_head_model_is_not_costed_with_vocabulary_logits():
    """Fixed: a critic or reward model (a scalar value head: ValueModel in flowrl/backends/local/models.py) was
    held and costed with full-vocabulary logits, its activations an actor's (~93% of them fp32 logits over
    151936 tokens); it is costed as it computes (`ModelSpec.scalar_head`)."""
    graph, _ = api.load(PPO_RM)
    small = MODEL_PRESETS["qwen2.5-0.5b"]
    tuner = Tuner(graph, small, parse_cluster("8xH100-80G"), WorkloadSpec(), models={m: small for m in graph.models})

    def score(model: str) -> tuple:
        return tuner.score(ModelLayout(model=model, group="all", parallel=Parallel(dp=8, tp=1, pp=1), micro_batch=4))

    actor, critic = score("actor"), score("critic")  # both: one forward node and one train node
    assert critic[3] < 0.5 * actor[3]  # activations: no (micro-batch x sequence x vocabulary) fp32 logits
    assert critic[1] < actor[1]  # seconds: no vocabulary projection


def test_a_model_spec_file_with_a_typo_names_the_field(tmp_path, capsys):
    text = "name: my-model\nnum_layers: 32\nhidden: 4096\nheads: 32\nkv_heads: 32\nintermediate: 11008\nvocab: 32000\n"
    err = fails(capsys, "grpo", *H100, "--model", write(tmp_path / "mine.yaml", text))
    assert "layers" in err and "entry 'name'" not in err


@pytest.mark.parametrize("model", ["llama-7b", "actor=llama-7b,reward=llama-7b"], ids=["preset", "per-role"])
def test_a_cluster_model_without_a_cluster_says_add_cluster(capsys, model):
    err = fails(capsys, "grpo", "--model", model)
    assert "--cluster" in err and "does not exist" not in err


def test_a_cluster_files_efficiency_curve_takes_the_ridge_from_its_hardware(tmp_path):
    curve = "{e_max: 0.3, k_w: 1.5, k_a: 4.5, e_attn: 0.15}"
    path = write(tmp_path / "cluster.yaml", f"nodes: 1\nhardware:\n  preset: H100-80G\n  efficiency: {curve}\n")
    hw = parse_cluster(path).hardware
    assert hw.efficiency.ridge == pytest.approx(hw.peak_flops_bf16 / hw.memory_bandwidth)


def test_a_bad_model_without_a_cluster_exits_without_loading_torch():
    assert probe(["plan", "grpo", "--model", "llama-7b"]) == {"codes": [2], "heavy": []}
