"""The example plugin distribution, found through real entry-point metadata, runs its graph."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flowrl import api
from flowrl.plugins.manager import load_plugins

EXAMPLE = Path(__file__).resolve().parents[2] / "plugins" / "flowrl-example"


def install_metadata(site: Path) -> None:
    """What `pip install` leaves behind: a dist-info folder with an entry_points.txt."""
    info = site / "flowrl_example_under_test-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flowrl-example-under-test\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[flowrl]\nexample_under_test = flowrl_example\n")


@pytest.mark.slow
def test_entry_point_plugin_registers_and_runs(tmp_path, monkeypatch):
    install_metadata(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("FLOWRL_PLUGINS", "example_under_test")  # only this entry point, not an installed copy
    sys.modules.pop("flowrl_example", None)
    _, reg = load_plugins()
    sources = {p.name: p.source for p in reg.plugins}
    assert "flowrl-example-under-test 0.1.0" in sources["example_under_test"]
    assert reg.entry("reward_functions", "concise").plugin == "example_under_test"
    assert reg.entry("algorithms", "grpo_concise").plugin == "example_under_test"
    assert "sample-prompts" in reg.names("cli_commands")

    overrides = [
        "steps=3",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "checkpoint=false",
        "progress=false",
        f"out={tmp_path / 'runs'}",
    ]
    graph, plan = api.plan("grpo_concise", registry=reg, overrides=overrides, emit=lambda s: None)
    assert graph.nodes["reward"].fn == "concise"
    result = api.run(graph, plan, registry=reg)
    assert len(result.metrics) == 3
    assert all(0.0 <= m["reward"] <= 1.0 for m in result.metrics)


def test_allow_list_excludes_unlisted_entry_points(tmp_path, monkeypatch):
    install_metadata(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("FLOWRL_PLUGINS", "")
    _, reg = load_plugins()
    assert "concise" not in reg.names("reward_functions")
    assert [p.name for p in reg.plugins] == ["flowrl.plugins.builtin"]
