"""A preference loss from a plugin: the example plugin's SimPO loss and graph are found through its
entry point, registered with rows='pairs' like the built-in DPO loss, and train on the tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from flowrl import api
from flowrl.contract.data import Completion, Prompt
from flowrl.plugins.manager import load_plugins
from flowrl.runtime.offline import offline_sequences
from flowrl.specs import AlgoConfig
from flowrl.tasks.tokenizer import build_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "plugins" / "flowrl-example"


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """The plugin manager with the example plugin found through its entry point (as `pip install` leaves it)."""
    info = tmp_path / "site" / "flowrl_example_under_test-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flowrl-example-under-test\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[flowrl]\nexample_under_test = flowrl_example\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("FLOWRL_PLUGINS", "example_under_test")
    for name in [m for m in sys.modules if m.startswith("flowrl_example")]:
        monkeypatch.delitem(sys.modules, name)
    return load_plugins()[1]


def test_the_plugins_simpo_loss_is_registered_as_a_pair_loss(registry):
    entry = registry.entry("losses", "simpo")
    assert entry.plugin == "example_under_test" and entry.meta["rows"] == "pairs"
    assert registry.entry("losses", "dpo").meta["rows"] == "pairs"  # the built-in registers the same way
    assert registry.entry("algorithms", "simpo").plugin == "example_under_test"
    pair = (Completion(pieces=("ab",), trained=(True,), eos=True), Completion(pieces=("b",), trained=(True,), eos=True))
    seqs, _ = offline_sequences([Prompt(text="ab>", answer="ab", completions=pair)], None, build_tokenizer(), 0,
                                rows="pairs")  # fmt: skip
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-3.0, -3.0, 0.0]])  # means -1 and -3 over 3 and 2 tokens
    loss, stats = entry.obj(logprobs, {"responses": seqs}, AlgoConfig(), beta=2.0, target_margin=1.0)
    h = 2.0 * (-1.0) - 2.0 * (-3.0) - 1.0
    assert float(loss) == pytest.approx(-float(torch.nn.functional.logsigmoid(torch.tensor(h))))
    assert stats["margin"] == pytest.approx(4.0) and stats["pref_accuracy"] == 1.0


@pytest.mark.slow
def test_the_plugins_simpo_graph_trains_the_tiny_model_toward_the_chosen_responses(registry, tmp_path):
    graph, plan = api.plan(
        "simpo", registry=registry, emit=lambda s: None, flags={"steps": 12},
        overrides=["progress=false", "rollout.prompts_per_step=8", "eval.every=12", "checkpoint=false"],
    )  # fmt: skip
    assert [n.kind for n in plan.nodes] == ["source", "train"]  # reference-free: no forward node
    assert plan.options["train_actor"].options["target_margin"] == 1.0  # the loss's option, not an algo field
    result = api.run(graph, plan, registry=registry, out_dir=tmp_path / "run")
    first, last = result.evals[0], result.evals[-1]
    assert last["eval/margin"] > first["eval/margin"]
    assert last["eval/preference_accuracy"] > first["eval/preference_accuracy"]
    assert "train_actor/pref_accuracy" in result.metrics[-1]
