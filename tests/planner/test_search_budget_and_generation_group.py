"""`flowrl plan --budget all` (every candidate simulated) and `--require generation.devices=N` (the size of the
group that generates), from the CLI and the Python API: bad values named, plans that hold the size, and graphs
or tensor-parallel sizes it cannot apply to refused by the requirement, not by a later check."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from flowrl import api
from flowrl.cli import main
from flowrl.contract.plan import load_plan
from flowrl.errors import ConfigError
from flowrl.planner.passes import PassResults

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--cluster", "4xA100-80G", "--model", "qwen2.5-0.5b"]
BIG = ["--cluster", "16xA100-80G", "--model", "llama-7b"]


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def _generation_group(layout):
    return next(g for g in layout.groups if g.name == layout.generation.group)


# ------------------------------------------------------------------ --budget


@pytest.mark.parametrize("word", ["ALL", " all "])
def test_budget_all_is_accepted_in_any_case_and_with_spaces(tmp_path, capsys, word):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "grpo", *SMALL, "--budget", word, "--out", str(out)]) == 0
    assert load_plan(out).layout is not None


@pytest.mark.parametrize("value", ["0", "--budget=-1", "nan", "inf", "--budget=-inf", "1e400", "everything", "8 s"])
def test_a_bad_budget_is_one_error_paragraph_naming_budget(capsys, value):
    flag = [value] if value.startswith("--budget=") else ["--budget", value]
    assert main(["plan", "grpo", *SMALL, *flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowrl: error: --budget is "), err
    assert "--budget all" in err and "Traceback" not in err and "usage:" not in err


def test_a_bad_budget_is_refused_for_a_local_plan_too(capsys):
    assert main(["plan", "grpo", "--budget", "nan"]) == 2
    assert _err(capsys).startswith("flowrl: error: --budget is nan")


@pytest.mark.slow
def test_budget_all_plans_a_local_graph_without_a_cluster(capsys):
    assert main(["plan", "grpo", "--budget", "all", "--explain"]) == 0
    assert "winner:" in capsys.readouterr().out


@pytest.mark.slow
def test_budget_all_with_what_if_prints_the_comparison(capsys):
    argv = ["plan", "grpo", *SMALL, "--budget", "all", "--what-if", "cluster.devices=8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "what if: cluster.devices=8" in out and "s/iteration" in out


@pytest.mark.slow
def test_api_budget_inf_simulates_every_candidate_like_the_cli_budget_all(capsys):
    """`api.plan(options={"budget_s": inf})` is what `--budget all` passes: the search counts every candidate,
    as an ample finite budget does."""
    counts = []
    for budget in ("all", "100000"):
        from flowrl import cli

        results = PassResults()

        args = cli.build_parser().parse_args(["plan", "grpo", *SMALL, "--budget", budget])
        kwargs = cli._load_kwargs(args)
        target = cli._cluster_target(args, kwargs)
        options = {"budget_s": cli._search_budget(args.budget)}
        api.plan("grpo", target=target, options=options, results=results, emit=lambda s: None, **kwargs)
        counts.append(results.place.tune.considered)
    assert counts[0] == counts[1] > 8


@pytest.mark.parametrize("budget_s", [float("nan"), 0.0, -1.0])
def test_api_refuses_a_budget_the_cli_refuses(budget_s):
    """The API refuses the budgets the CLI refuses, naming budget_s: NaN would plan as if unlimited, and 0 or
    -1 with a single candidate."""
    from flowrl import cli

    args = cli.build_parser().parse_args(["plan", "grpo", *SMALL])
    kwargs = cli._load_kwargs(args)
    target = cli._cluster_target(args, kwargs)
    with pytest.raises(ConfigError, match="budget_s"):
        api.plan("grpo", target=target, options={"budget_s": budget_s}, emit=lambda s: None, **kwargs)


# ------------------------------------------------------------------ --require generation.devices


@pytest.mark.slow
def test_explain_names_generation_devices_in_the_constrained_line(capsys):
    argv = ["plan", "grpo", *SMALL, "--budget", "all", "--require", "generation.devices=2", "--explain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("constrained ("))
    assert line.startswith("constrained (generation.devices=2):") and "[gen:2]" in line


@pytest.mark.slow
def test_a_plan_written_with_budget_all_and_a_generation_group_size_loads(tmp_path, capsys):
    out, png = tmp_path / "plan.yaml", tmp_path / "plan.png"
    argv = ["plan", "grpo", *SMALL, "--budget", "ALL", "--require", "generation.devices=2"]
    assert main([*argv, "--out", str(out), "--timeline", str(png)]) == 0
    layout = load_plan(out).layout
    assert _generation_group(layout).devices == 2
    assert layout.generation.tp * layout.generation.replicas == 2
    assert png.with_suffix(".json").exists()


@pytest.mark.parametrize("second", ["generation.devices=8", "generation.devices=16"])
def test_generation_devices_named_twice_is_refused(capsys, second):
    argv = ["plan", "grpo", *BIG, "--budget", "1", "--require", "generation.devices=8", "--require", second]
    assert main(argv) == 2
    assert "names 'generation.devices' twice" in _err(capsys)


@pytest.mark.parametrize("value", ["0", "8.0", "none", "-2"])
def test_a_generation_group_size_that_is_not_a_count_is_refused(capsys, value):
    assert main(["plan", "grpo", *SMALL, "--require", f"generation.devices={value}"]) == 2
    assert "give a whole number >= 1" in _err(capsys)


def test_generation_devices_beyond_a_one_device_cluster_names_the_one_size(capsys):
    argv = ["plan", "grpo", "--cluster", "1xA100-80G", "--model", "qwen2.5-0.5b", "--budget", "1"]
    assert main([*argv, "--require", "generation.devices=8"]) == 2
    err = _err(capsys)
    assert "generates on a group of 8 device(s)" in err and "may run on: 1." in err


def test_generation_devices_that_contradict_the_placement_list_what_that_placement_has(capsys):
    argv = ["plan", "grpo", *BIG, "--budget", "1", "--placement", "colocate", "--require", "generation.devices=8"]
    assert main(argv) == 2
    assert "may run on: 16." in _err(capsys)


def test_generation_devices_sizes_listed_are_those_the_required_tp_allows(capsys):
    argv = ["plan", "grpo", *BIG, "--budget", "1", "--require", "generation.tp=8"]
    assert main([*argv, "--require", "generation.devices=4"]) == 2
    assert "may run on: 8, 16." in _err(capsys)


@pytest.mark.slow
def test_a_required_generation_group_size_holds_across_a_what_if(capsys):
    argv = ["plan", "grpo", *SMALL, "--budget", "1", "--require", "generation.devices=2"]
    assert main([*argv, "--what-if", "cluster.devices=8"]) == 0
    generation = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("generation "))
    assert generation.count(":2") == 2, generation  # @gen:2 in both columns


@pytest.mark.parametrize("devices", [6, pytest.param(7, marks=pytest.mark.slow)])
def test_a_generation_group_size_with_no_whole_tp_split_still_plans_one_that_fills_it(tmp_path, capsys, devices):
    """A group of 6 (or 7) devices generates with replicas that fill it (tp1 x 6, tp2 x 3; tp1 x 7): the plan
    space has no generation layout whose tp leaves devices idle (tp 4 x 1 replica on 6), which the plan
    verifier would refuse after the search picked it."""
    out = tmp_path / "plan.yaml"
    argv = ["plan", "grpo", "--cluster", "8xA100-80G", "--model", "llama-7b", "--budget", "all"]
    code = main([*argv, "--require", f"generation.devices={devices}", "--out", str(out)])
    err = _err(capsys)
    assert "after pass 'place'" not in err, err
    assert code == 0, err
    layout = load_plan(out).layout
    assert _generation_group(layout).devices == devices
    assert layout.generation.tp * layout.generation.replicas == devices


def test_a_generation_tp_that_does_not_divide_the_required_group_is_refused_by_the_requirement(capsys):
    """`--require generation.tp=2 --require generation.devices=3`: tp 2 does not fill 3 devices, and the
    requirement's own error says so (naming generation.devices), not the plan verifier after the search."""
    argv = ["plan", "grpo", "--cluster", "4xA100-80G", "--model", "llama-7b", "--budget", "all"]
    assert main([*argv, "--require", "generation.tp=2", "--require", "generation.devices=3"]) == 2
    err = _err(capsys)
    assert "after pass 'place'" not in err, err
    assert "generation.devices" in err


@pytest.mark.parametrize("graph", ["dpo", "sft"])
def test_generation_devices_on_a_graph_that_generates_nothing_is_refused(capsys, graph):
    """A graph that generates nothing (DPO, SFT) has no generation group: `generation.devices` is refused saying
    so, rather than pinning the actor's training group to that size."""
    argv = ["plan", str(ROOT / "graphs" / f"{graph}.py"), *SMALL, "--budget", "1"]
    assert main([*argv, "--require", "generation.devices=2"]) == 2
    err = _err(capsys)
    assert re.search(r"generates nothing|no generation|does not generate|nothing to generate", err), err


def test_budget_inf_through_api_is_not_refused(capsys):
    """`budget_s=math.inf` is a valid API budget (the CLI's `--budget all`)."""
    from flowrl.planner.passes.context import plan_options

    assert plan_options({"budget_s": math.inf}).budget_s == math.inf
