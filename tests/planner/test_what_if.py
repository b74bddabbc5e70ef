"""`flowrl plan --what-if KEY=VALUE`: the plan for a changed cluster, hardware, workload or run config, beside
the current one."""

from __future__ import annotations

import re

import pytest

from flowrl.cli import main
from flowrl.contract.workload import Fixed, Histogram, LogNormal, WorkloadSpec
from flowrl.errors import ConfigError
from flowrl.planner.hardware import parse_cluster
from flowrl.planner.whatif import longer_tail, parse_what_if, resized, with_hardware, with_workload

NAMED = ["plan", "grpo", "--cluster", "8xH100-80G", "--model", "llama-7b", "--budget", "1"]


def table(out: str) -> dict[str, list[str]]:
    """The comparison's rows: label -> [current, what-if, new/current] (cells split on 2+ spaces)."""
    rows = {}
    for line in out.splitlines():
        if not line.startswith("  "):
            continue
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


def seconds(cell: str) -> float:
    return float(cell.replace(",", ""))


@pytest.mark.slow
def test_twice_the_devices_lowers_or_keeps_the_predicted_time(capsys):
    code = main([*NAMED, "--what-if", "cluster.devices=16"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = table(out)
    assert rows["cluster"][:2] == ["1x8xH100-80G", "2x8xH100-80G"]
    before, after = seconds(rows["s/iteration"][0]), seconds(rows["s/iteration"][1])
    assert after <= before
    ratio = float(rows["s/iteration"][2].rstrip("x"))
    assert ratio <= 1.0 and ratio == pytest.approx(after / before, abs=0.02)
    assert seconds(rows["samples/s"][1]) >= seconds(rows["samples/s"][0])
    assert any(label.startswith("memory ") for label in rows)
    assert out.strip().splitlines()[-1].startswith("changed: ")


@pytest.mark.slow
def test_a_factor_doubles_the_devices_as_a_count_does(capsys):
    assert main([*NAMED, "--what-if", "cluster.devices=2x"]) == 0
    assert table(capsys.readouterr().out)["cluster"][1] == "2x8xH100-80G"


@pytest.mark.slow
def test_an_async_what_if_changes_the_rollout_mode(capsys):
    code = main([*NAMED, "--set", "rollout.mode=sync", "--what-if", "rollout.mode=async"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rollout = table(out)["rollout"]
    assert rollout[0] == "sync" and rollout[1].startswith("async")
    assert "rollout sync -> async" in out.splitlines()[-1]


@pytest.mark.slow
def test_a_staleness_bound_alone_plans_async_within_it_and_says_so(capsys):
    code = main([*NAMED, "--what-if", "rollout.staleness=2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert table(out)["rollout"][1] == "async eta=2"
    assert "note: rollout.staleness alone" in out


@pytest.mark.slow
def test_a_faster_interconnect_is_planned_on_the_changed_hardware(capsys):
    code = main([*NAMED, "--what-if", "cluster.devices=16", "--what-if", "hardware.inter_node_bandwidth=4x"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = table(out)
    assert rows["cluster"][1] == "2x8xH100-80G" and "s/iteration" in rows


@pytest.mark.parametrize(
    ("item", "needles"),
    [
        ("cluster.gpus=16", ["unknown key 'cluster.gpus'", "devices, nodes, devices_per_node"]),
        ("rollout.mdoe=async", ["unknown key 'rollout.mdoe'", "Did you mean 'rollout.mode'?"]),
        ("interconnect=2x", ["unknown key 'interconnect'", "hardware.{", "workload.{", "rollout.staleness=2"]),
        ("hardware.inter_node_bw=2x", ["Did you mean 'hardware.inter_node_bandwidth'?"]),
        ("out=elsewhere", ["run setting", "does not change the plan"]),
        ("cluster.devices", ["write KEY=VALUE"]),
        ("cluster.devices=many", ["give a number > 0", "'many'"]),
        ("cluster.devices=12", ["12 devices do not fill whole 8-device nodes"]),
        ("workload.response_tail=2x", ["fixed length has no tail"]),
        ("workload.padded_to=2x", ["no padded_to to scale", "workload.padded_to=N"]),  # unset: None
    ],
)
def test_a_bad_what_if_errors_naming_the_item_without_a_traceback(capsys, item, needles):
    code = main([*NAMED, "--what-if", item])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("flowrl: error: --what-if") and "Traceback" not in err
    text = " ".join(err.split())
    for needle in needles:
        assert needle in text, (needle, text)


def test_what_if_refuses_flags_that_write_or_explain_one_plan(capsys, tmp_path):
    code = main([*NAMED, "--what-if", "cluster.devices=16", "--out", str(tmp_path / "p.yaml")])
    _, err = capsys.readouterr()
    assert code == 2 and "--what-if prints the current plan beside the changed one; drop --out" in err
    assert not (tmp_path / "p.yaml").exists()


def test_this_machine_as_more_devices_is_a_forecast_on_split_cpus(capsys):
    code = main(["plan", "grpo", "--budget", "1", "--what-if", "cluster.devices=2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert table(out)["cluster"][1] == "cpu:2"
    assert "is a forecast for any executor" in out


# ------------------------------------------------------------------ the target changes themselves


def test_resizing_keeps_the_node_size_and_packs_small_counts_on_one_node():
    cluster = parse_cluster("2x8xH100-80G")
    grown = resized(cluster, list(parse_what_if(["cluster.devices=32"]).changes))
    assert (grown.nodes, grown.devices_per_node) == (4, 8)
    small = resized(cluster, list(parse_what_if(["cluster.devices=4"]).changes))
    assert (small.nodes, small.devices_per_node) == (1, 4)
    assert small.hardware == cluster.hardware


def test_resizing_this_machines_cpu_cuts_the_same_machine_again():
    from flowrl.planner.hardware import HARDWARE_PRESETS, cpu_cluster

    machine = HARDWARE_PRESETS["A100-80G"]
    two = cpu_cluster(machine, 2)
    four = resized(two, list(parse_what_if(["cluster.devices=4"]).changes))
    assert four.label == "cpu:4"
    assert four.hardware.peak_flops_bf16 == pytest.approx(machine.peak_flops_bf16 / 4)
    assert four.hardware.memory_bytes == machine.memory_bytes // 4


def test_hardware_changes_are_checked_like_a_cluster_file():
    cluster = parse_cluster("8xA100-80G")
    faster = with_hardware(cluster, list(parse_what_if(["hardware.inter_node_bandwidth=2x"]).changes))
    assert faster.hardware.inter_node_bandwidth == 2 * cluster.hardware.inter_node_bandwidth
    set_to = with_hardware(cluster, list(parse_what_if(["hardware.inter_node_bandwidth=4e11"]).changes))
    assert set_to.hardware.inter_node_bandwidth == 4e11
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        with_hardware(cluster, list(parse_what_if(["hardware.matmul_efficiency=2"]).changes))


def test_a_longer_tail_keeps_the_median_and_stretches_the_99th_percentile():
    import math

    dist = LogNormal(median=500, sigma=0.8, max=4096)
    item = parse_what_if(["workload.response_tail=2x"]).changes[0]
    longer = longer_tail(dist, item)
    assert longer.median == 500 and longer.max == 8192
    p99 = lambda d: d.median * math.exp(2.326 * d.sigma)  # noqa: E731
    assert p99(longer) == pytest.approx(2 * p99(dist), rel=1e-3)
    hist = Histogram(lengths=[10, 20, 30, 400], weights=[1, 1, 1, 1])
    stretched = longer_tail(hist, item)
    assert stretched.lengths == [10, 20, 60, 800]


def test_workload_fields_take_numbers_and_factors():
    base = WorkloadSpec(prompts_per_step=256, response_length=LogNormal(median=300, sigma=1.0, max=2048))
    changes = list(parse_what_if(["workload.prompts_per_step=2x", "workload.response_length=2x"]).changes)
    w = with_workload(base, changes)
    assert w.prompts_per_step == 512
    assert w.response_length == LogNormal(median=600, sigma=1.0, max=4096)
    fixed = with_workload(base, list(parse_what_if(["workload.response_length=1500"]).changes))
    assert fixed.response_length == Fixed(value=1500)


def test_config_items_become_set_overrides_and_target_items_do_not():
    what = parse_what_if(["rollout.mode=async", "cluster.devices=16", "hardware.memory_bytes=2x"])
    assert what.overrides == ("rollout.mode=async",)
    assert [(c.part, c.field, c.relative) for c in what.changes] == [
        ("cluster", "devices", False),
        ("hardware", "memory_bytes", True),
    ]


@pytest.mark.slow
def test_an_async_what_if_shows_the_time_to_target_beside_the_samples_per_second(capsys):
    """Async trains on stale samples: more steps to the target, each cheaper; both show, from the plans'
    recorded objective (steps x seconds per iteration)."""
    code = main([*NAMED, "--set", "rollout.mode=sync", "--what-if", "rollout.mode=async", "--target-steps", "100"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = table(out)
    steps = [seconds(c) for c in rows["steps to target"][:2]]
    assert steps[0] == pytest.approx(100, abs=0.5) and steps[1] > steps[0]  # stale samples cost steps
    for col in (0, 1):
        per_iteration = seconds(rows["s/iteration"][col])
        assert seconds(rows["s to target"][col]) == pytest.approx(steps[col] * per_iteration, rel=0.02)
