"""Issue 21: `--set nodes.NAME.FIELD=VALUE` for an algo field is that field for one node, so it must
meet the same checks as `--set algo.FIELD=VALUE` (RunConfig's ranges). Today the node's AlgoConfig
is converted without them: `--set algo.clip_low=5` is refused, `--set nodes.train_actor.clip_low=5`
is planned (and runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.cli import main

SMALL = ["--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


def test_the_config_wide_field_is_refused(capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(
        capsys, "plan", "grpo", *SMALL, "--set", "algo.clip_low=5", "--out", str(tmp_path / "p.yaml")
    )
    assert code == 2 and "algo.clip_low' must be in (0, 1)" in err, err


@pytest.mark.parametrize(
    "setting",
    [
        "nodes.train_actor.clip_low=5",
        "nodes.train_actor.dual_clip=0.5",
        "nodes.train_actor.is_cap=0",
        "nodes.advantages.clip_high=-1",
    ],
)
def test_the_same_field_for_one_node_is_refused_naming_the_node(capsys, tmp_path: Path, setting: str) -> None:
    out = tmp_path / "p.yaml"
    code, _, err = run_cli(capsys, "plan", "grpo", *SMALL, "--set", setting, "--out", str(out))
    node, field = setting.split(".")[1], setting.split(".")[2].split("=")[0]
    assert code == 2 and "Traceback" not in err, err
    assert node in err and field in err, err
    assert not out.exists()
