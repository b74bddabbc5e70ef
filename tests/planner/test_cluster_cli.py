"""`flowrl plan --cluster`: errors with numbers, plugins (hardware, passes, cost models), plan files, timelines."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from flowrl import api
from flowrl.cli import main
from flowrl.contract.plan import ClusterTarget, dump_plan, load_plan
from flowrl.contract.workload import LogNormal
from flowrl.errors import PlanError, PluginError
from flowrl.planner.cost import CostModel
from flowrl.planner.hardware import HardwareSpec, parse_cluster
from flowrl.planner.modelspec import MODEL_PRESETS
from flowrl.planner.passes import PIPELINE, PassResults
from flowrl.planner.simulate import timeline_json
from flowrl.planner.space import RolloutPolicy
from flowrl.planner.workload import WorkloadSpec
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import load_plugins, set_registry

GiB = 1024**3
FAST = ["--budget", "1"]


def flat(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------ 4. nothing fits: say by how much, and what to try


def test_llama_70b_ppo_on_8_a100_40g_fails_with_the_shortfall(capsys):
    code = main(["plan", "graphs/ppo_rm.py", "--cluster", "8xA100-40G", "--model", "llama-70b"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("flowrl: error:") and "Traceback" not in err
    text = flat(err)
    for needle in ("no plan fits", "llama-70b", "8 x A100-40G", "GiB", "short by"):
        assert needle in text, (needle, text)
    short = re.search(r"short by ([0-9.]+) GiB", text)
    assert short and float(short.group(1)) > 0
    bigger = re.search(r"--cluster (\d+)x(\S+)", text)
    assert bigger, text
    count, name = int(bigger.group(1)), bigger.group(2)
    assert count > 8 and name.startswith("A100-40G")
    at_least = re.search(r"at least (\d+) of these devices", text)
    assert at_least and count >= int(at_least.group(1)) > 8


@pytest.mark.slow
def test_the_suggested_cluster_is_enough():
    err = None
    try:
        api.plan(
            "graphs/ppo_rm.py",
            target=ClusterTarget(
                cluster=parse_cluster("8xA100-40G"), model=MODEL_PRESETS["llama-70b"], workload=WorkloadSpec()
            ),
            emit=lambda s: None,
        )
    except PlanError as exc:
        err = flat(str(exc))
    assert err is not None
    suggestion = re.search(r"--cluster (\S+?x\S+?) ", err).group(1)
    _, plan = api.plan(
        "graphs/ppo_rm.py",
        target=ClusterTarget(
            cluster=parse_cluster(suggestion), model=MODEL_PRESETS["llama-70b"], workload=WorkloadSpec()
        ),
        options={"budget_s": 2},
        emit=lambda s: None,
    )
    assert plan.layout.predicted.iteration_s > 0


def test_a_model_too_big_for_any_layout_on_one_device(capsys):
    """A one-device forecast is searched (offload, micro-batches); when nothing fits, the tuner says by
    how much and which cluster would do."""
    code = main(["plan", "grpo", "--cluster", "1xA100-80G", "--model", "llama-34b", *FAST])
    out, err = capsys.readouterr()
    text = flat(err)
    assert code == 2 and out == "" and text.startswith("flowrl: error:") and "Traceback" not in text
    for needle in ("no plan fits", "A100-80G", "GiB", "try --cluster 8xA100-80G"):
        assert needle in text, (needle, text)


# ------------------------------------------------------------------ 7. plugins: a hardware preset, a pass, a cost model

TPU_X = HardwareSpec(
    name="TPU-X",
    peak_flops_bf16=459e12,
    peak_flops_fp32=100e12,
    memory_bytes=95 * GiB,
    memory_bandwidth=2.7e12,
    intra_node_bandwidth=300e9,
    inter_node_bandwidth=50e9,
)
COST_MODEL_CALLS: list[tuple[str, str]] = []


def no_partial(ctx, plan):
    """Site policy: on-policy, no partial rollouts."""
    return msgspec.structs.replace(plan, layout=msgspec.structs.replace(plan.layout, rollout=RolloutPolicy()))


def recording_cost_model(model, hardware):
    COST_MODEL_CALLS.append((model.name, hardware.name))
    return CostModel(model, hardware)


class FakePlugin:
    @hookimpl
    def register_hardware(self, register):
        register("TPU-X", TPU_X, description="a made-up accelerator")

    @hookimpl
    def register_passes(self, register):
        register("no_partial", no_partial)

    @hookimpl
    def register_cost_models(self, register):
        register("recording", recording_cost_model)


@pytest.fixture
def reg():
    _, registry = load_plugins(entry_points=False, extra=[("fake", FakePlugin())])
    set_registry(registry)
    COST_MODEL_CALLS.clear()
    yield registry
    set_registry(None)


def tpu_cluster(reg, devices: int = 16):
    return parse_cluster(f"{devices}xTPU-X", extra_presets={e.name: e.obj for e in reg.entries("hardware")})


def test_plugin_hardware_preset_is_a_cluster(reg):
    cluster = tpu_cluster(reg)
    assert cluster.hardware == TPU_X and (cluster.nodes, cluster.devices_per_node) == (2, 8)
    assert reg.entry("hardware", "TPU-X").plugin == "fake"
    assert "A100-80G" in reg.names("hardware")  # the built-ins are still there


@pytest.mark.slow
def test_plugin_pass_runs_after_the_tuner(reg):
    target = ClusterTarget(
        cluster=tpu_cluster(reg),
        model=MODEL_PRESETS["llama-7b"],
        workload=WorkloadSpec(response_length=LogNormal(median=512, sigma=1.5, max=8192)),
    )
    _, tuned = api.plan("grpo", registry=reg, target=target, options={"budget_s": 2}, emit=lambda s: None)
    passes = (*PIPELINE, "no_partial")
    _, plan = api.plan("grpo", registry=reg, target=target, passes=passes, options={"budget_s": 2}, emit=lambda s: None)
    assert plan.passes == passes
    assert plan.layout.rollout == RolloutPolicy()
    assert plan.target.cluster.hardware.name == "TPU-X"
    cap = TPU_X.memory_bytes
    assert all(v <= cap for v in plan.layout.predicted.memory_bytes.values())
    # the pass changed only the rollout policy of the tuner's plan
    assert msgspec.structs.replace(tuned.layout, rollout=RolloutPolicy()) == plan.layout
    assert plan.id == plan.content_id() != tuned.id


def test_plugin_cost_model_is_used_when_named(reg):
    target = ClusterTarget(cluster=tpu_cluster(reg), model=MODEL_PRESETS["qwen2.5-1.5b"], workload=WorkloadSpec())
    _, plan = api.plan(
        "grpo", registry=reg, target=target, options={"budget_s": 1, "cost_model": "recording"}, emit=lambda s: None
    )
    assert COST_MODEL_CALLS == [("qwen2.5-1.5b", "TPU-X")]
    assert plan.layout.predicted.iteration_s > 0
    with pytest.raises(PluginError, match="unknown cost model 'nope'"):
        api.plan(
            "grpo", registry=reg, target=target, options={"budget_s": 1, "cost_model": "nope"}, emit=lambda s: None
        )


def test_plugin_preset_pass_and_explain_through_the_cli(reg, capsys):
    code = main(
        ["plan", "grpo", "--cluster", "16xTPU-X", "--model", "llama-7b", "--pass", "no_partial", "--explain", *FAST]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    for needle in ("winner:", "runners-up:", "roofline", "per node", "loses on:"):
        assert needle in out, (needle, out)
    winner = next(line for line in out.splitlines() if line.startswith("winner:"))
    assert re.match(r"winner: [0-9.]+ s/iteration ", winner)
    assert "16 x 459 TFLOP/s" in out  # the roofline uses the plugin's hardware


def test_cli_cost_model_flag(reg, capsys):
    assert (
        main(
            [
                "plan",
                "grpo",
                "--cluster",
                "8xTPU-X",
                "--model",
                "qwen2.5-0.5b",
                "--cost-model",
                "recording",
                "--explain",
                *FAST,
            ]
        )
        == 0
    )
    assert COST_MODEL_CALLS == [("qwen2.5-0.5b", "TPU-X")]
    assert main(["plan", "grpo", "--cluster", "8xTPU-X", "--model", "qwen2.5-0.5b", "--cost-model", "nope", *FAST]) == 2
    assert "unknown cost model 'nope'" in capsys.readouterr().err


def test_unknown_plugin_pass_is_a_user_error(reg, capsys):
    assert main(["plan", "grpo", "--cluster", "8xTPU-X", "--model", "qwen2.5-0.5b", "--pass", "no_partail", *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowrl: error:") and "no_partial" in err  # did you mean


# ------------------------------------------------------------------ 8. plan files, timelines, refusals


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One CLI run that writes a cluster plan and a timeline."""
    d = tmp_path_factory.mktemp("cluster-plan")
    out, png = d / "plan.yaml", d / "pics" / "timeline.png"
    code = main(
        [
            "plan",
            "grpo",
            "--cluster",
            "16xA100-80G",
            "--model",
            "qwen2.5-1.5b",
            "--out",
            str(out),
            "--timeline",
            str(png),
            *FAST,
        ]
    )
    assert code == 0
    return out, png


@pytest.mark.slow
def test_timeline_png_and_json_beside_it(planned):
    _, png = planned
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(png.with_suffix(".json").read_text())
    assert data["iteration_s"] > 0 and data["spans"]
    plan = load_plan(planned[0])
    groups = {g.name for g in plan.layout.groups}
    for span in data["spans"]:
        assert set(span) == {"iteration", "task", "groups", "start", "end"}
        assert set(span["groups"]) <= groups and span["end"] >= span["start"]
    assert data["iteration_s"] == pytest.approx(plan.layout.predicted.iteration_s, abs=1e-6)


def test_plan_file_round_trips_with_layout_and_target(planned, tmp_path):
    out, _ = planned
    plan = load_plan(out)
    assert plan.id == plan.content_id()
    assert plan.target is not None and plan.layout is not None
    assert plan.target.cluster == parse_cluster("16xA100-80G") and plan.target.model == MODEL_PRESETS["qwen2.5-1.5b"]
    assert plan.target.workload == WorkloadSpec()
    assert plan.layout.predicted is not None and plan.passes == PIPELINE
    assert {e.group for e in plan.memory} == {g.name for g in plan.layout.groups}
    assert all(e.required_bytes <= e.capacity_bytes for e in plan.memory)
    again = dump_plan(plan, tmp_path / "again.yaml")
    assert load_plan(again) == plan
    as_json = dump_plan(plan, tmp_path / "plan.json")
    assert load_plan(as_json) == plan


def test_edited_cluster_plan_is_refused(planned, tmp_path):
    out, _ = planned
    text = out.read_text()
    edited = tmp_path / "edited.yaml"
    edited.write_text(
        text.replace("partial: false", "partial: true", 1)
        if "partial: false" in text
        else text.replace("staleness: 0", "staleness: 3", 1)
    )
    assert edited.read_text() != text
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="edited after it was planned"):
        load_plan(edited)


def test_run_refuses_a_cluster_plan(planned, capsys):
    """The local executor's check names what it cannot run and how to get an executor that can."""
    out, _ = planned
    code = main(["run", "--plan", str(out), "--quiet"])
    err = flat(capsys.readouterr().err)
    assert code == 2 and err.startswith("flowrl: error:") and "Traceback" not in err
    for needle in ("executor 'local' cannot run this plan", "a cluster of 16 devices (at most 1)", "--executor NAME"):
        assert needle in err, (needle, err)


def test_run_refuses_a_cluster_plan_before_announcing_a_run(planned, capsys):
    out, _ = planned
    code = main(["run", "--plan", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    assert "running" not in captured.out
    assert captured.err.startswith("flowrl: error:"), captured.err[:80]


def test_yaml_and_json_stdout(capsys):
    assert main(["plan", "grpo", "--cluster", "8xA100-80G", "--model", "qwen2.5-0.5b", "--format", "json", *FAST]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"]["predicted"]["iteration_s"] > 0 and doc["target"]["cluster"]["nodes"] == 1


def test_workload_file_reaches_the_target(tmp_path, capsys):
    wl = tmp_path / "load.yaml"
    wl.write_text(
        "prompts_per_step: 64\nsamples_per_prompt: 8\nprompt_length: 256\nresponse_length: {kind: lognormal, "
        "median: 300, sigma: 1.0, max: 4096}\n"
    )
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "plan",
                "grpo",
                "--cluster",
                "8xA100-80G",
                "--model",
                "qwen2.5-0.5b",
                "--workload",
                str(wl),
                "--out",
                str(out),
                *FAST,
            ]
        )
        == 0
    )
    plan = load_plan(out)
    assert plan.target.workload == WorkloadSpec(
        prompts_per_step=64,
        samples_per_prompt=8,
        prompt_length=256,
        response_length=LogNormal(median=300, sigma=1.0, max=4096),
    )


def test_print_after_place_shows_the_cluster_plan(capsys):
    argv = ["plan", "grpo", "--cluster", "8xA100-80G", "--model", "qwen2.5-0.5b", "--print-after", "place", *FAST]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "# --- plan after pass 'place' ---" in out and "placement:" in out


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["plan", "grpo", "--workload", "load.yaml"], ["--workload plans for a cluster", "--cluster"]),
        (
            ["plan", "grpo", "--cluster", "12xA100-80G", "--model", "llama-7b"],
            ["12 devices", "whole", "8-device nodes"],
        ),
        (["plan", "grpo", "--cluster", "16xA100-80G"], ["--cluster needs --model"]),
        (["plan", "grpo", "--cluster", "16xB200", "--model", "llama-7b"], ["unknown hardware preset 'B200'"]),
        (["plan", "grpo", "--cluster", "16xA100-80G", "--model", "llama-8b"], ["model 'llama-8b'", "llama"]),
    ],
    ids=["workload-without-cluster", "partial-node", "no-model", "unknown-hardware", "unknown-model"],
)
def test_cluster_flag_errors(argv, needles, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("flowrl: error:") and "Traceback" not in err
    text = flat(err)
    for needle in needles:
        assert needle in text, (needle, text)
    assert not (tmp_path / "x.png").exists()


def test_explain_and_timeline_without_cluster_describe_this_machines_one_layout(tmp_path, capsys):
    """Without --cluster the plan is for this machine (one device): one colocated layout, predicted."""
    png = tmp_path / "local.png"
    assert main(["plan", "grpo", "--explain", "--timeline", str(png)]) == 0
    out = capsys.readouterr().out
    assert "searched 1 feasible plans" in out and "runners-up:" in out and "loses on:" not in out
    winner = next(line for line in out.splitlines() if line.startswith("winner:"))
    assert re.match(r"winner: [0-9.]+ s/iteration +colocate \[all:1\] ", winner), winner
    assert "| rollout sync | sync reshard" in winner  # what the local executor runs
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and json.loads(png.with_suffix(".json").read_text())["spans"]


@pytest.mark.slow
def test_timeline_spans_from_the_api_results_match_the_cli_json(tmp_path, capsys):
    """The JSON the CLI writes is timeline_json of the tuner's winning simulation."""
    results = PassResults()
    target = ClusterTarget(
        cluster=parse_cluster("16xA100-80G"), model=MODEL_PRESETS["qwen2.5-1.5b"], workload=WorkloadSpec()
    )
    _, plan = api.plan("grpo", target=target, results=results, options={"budget_s": 1}, emit=lambda s: None)
    png = tmp_path / "t.png"
    assert (
        main(
            [
                "plan",
                "grpo",
                "--cluster",
                "16xA100-80G",
                "--model",
                "qwen2.5-1.5b",
                "--timeline",
                str(png),
                "--explain",
                *FAST,
            ]
        )
        == 0
    )
    spans = json.loads(png.with_suffix(".json").read_text())["spans"]
    assert spans == timeline_json(results.place.tune.ranked[0].result)
    assert "timeline written to" in capsys.readouterr().out


@pytest.mark.slow
def test_budget_all_simulates_every_candidate_and_picks_what_an_ample_budget_picks(tmp_path, capsys):
    """`--budget all`: no time limit, every candidate simulated (the same plan on a slow machine as on a fast
    one); the explain line counts them, and an ample time budget picks the same plan."""
    base = ["plan", "grpo", "--cluster", "4xA100-80G", "--model", "qwen2.5-0.5b", "--force"]
    assert main([*base, "--budget", "all", "--explain", "--out", str(tmp_path / "all.yaml")]) == 0
    searched = re.search(r"searched (\d+) feasible plans", capsys.readouterr().out)
    assert searched and int(searched.group(1)) > 8
    assert main([*base, "--budget", "100000", "--out", str(tmp_path / "ample.yaml")]) == 0
    assert load_plan(tmp_path / "all.yaml").layout == load_plan(tmp_path / "ample.yaml").layout
