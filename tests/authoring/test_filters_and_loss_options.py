"""Filters that keep single rows, losses that take node options, and train nodes that read only
what their loss uses (issue 21, item 8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl import api
from flowrl.contract.data import Prompt, Sequences
from flowrl.errors import FlowRLError, PlanError
from flowrl.graph.ir import Filter, Graph
from flowrl.runtime.rollout import _take_groups

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "progress=false", "checkpoint=false"]


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path: Path, graph: str, *overrides: str) -> list[dict]:
    g, plan = api.plan(graph, overrides=[*SMALL, f"out={tmp_path}", *overrides], emit=lambda s: None)
    result = api.run(g, plan)
    return _records(result.out_dir)


@pytest.mark.slow
def test_a_row_filter_trains_on_exactly_the_rows_it_kept(tmp_path: Path) -> None:
    # min_reward 0: every row passes; 1.01: none does (the step's train is skipped, not run on junk)
    every = _run(tmp_path / "all", "graphs/rejection_sft.py", "steps=2", "nodes.select.min_reward=0.0")
    assert all(r["rollout/samples"] == 16 and r["select/fallback"] == 0 for r in every)
    assert all("train_actor/nll" in r for r in every)
    none = _run(tmp_path / "none", "graphs/rejection_sft.py", "steps=2", "nodes.select.min_reward=1.01")
    assert all(r["rollout/samples"] == 0 and r["select/fallback"] == 1 for r in none)
    assert all(r["train_actor/empty"] == 1 and "train_actor/nll" not in r for r in none)


def test_take_groups_keeps_only_the_marked_rows_of_the_chosen_groups() -> None:
    rows = 6  # 3 prompts x 2 samples
    seqs = Sequences(
        prompt_ids=torch.ones(rows, 2, dtype=torch.long),
        prompt_mask=torch.ones(rows, 2, dtype=torch.long),
        response_ids=torch.arange(rows)[:, None].repeat(1, 3),
        response_mask=torch.ones(rows, 3),
        prompt_index=torch.tensor([0, 0, 1, 1, 2, 2]),
        texts=tuple("abcdef"),
    )
    prompts = [Prompt(text=f"p{i}", answer="") for i in range(3)]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    kept = rewards > 0
    chosen, picked, out = _take_groups(prompts, seqs, {"rewards": rewards}, torch.tensor([2, 0]), kept)
    assert [p.text for p in chosen] == ["p2", "p0"]
    assert list(picked.texts) == ["f", "a"] and picked.prompt_index.tolist() == [0, 1]
    assert out["rewards"].tolist() == [1.0, 1.0]


def test_a_filter_declares_how_it_keeps() -> None:
    g = Graph("g")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.filter("select", fn="threshold", reads="rewards responses", by_row=True)
    node = g.nodes["select"]
    assert isinstance(node, Filter) and node.by_row
    with pytest.raises(FlowRLError, match="by_row must be True or False"):
        g.filter("other", fn="threshold", reads="rewards responses", by_row="yes")


@pytest.mark.slow
def test_a_loss_takes_node_options(tmp_path: Path) -> None:
    # the sft loss scales its value by its option 'scale': set from the command line, it reaches the loss
    base = _run(tmp_path / "a", "graphs/rejection_sft.py", "steps=1", "nodes.select.min_reward=0.0")
    scaled = _run(
        tmp_path / "b",
        "graphs/rejection_sft.py",
        "steps=1",
        "nodes.select.min_reward=0.0",
        "nodes.train_actor.scale=2.0",
    )
    assert scaled[0]["train_actor/nll"] == pytest.approx(base[0]["train_actor/nll"])
    assert scaled[0]["train_actor/loss"] == pytest.approx(2 * base[0]["train_actor/loss"], rel=1e-5)


def test_an_unknown_loss_option_is_refused_naming_it() -> None:
    with pytest.raises(FlowRLError, match="unknown option.*scal"):
        api.plan("graphs/rejection_sft.py", overrides=[*SMALL, "nodes.train_actor.scal=2.0"], emit=lambda s: None)


def test_a_train_node_reading_a_key_its_loss_ignores_is_refused(tmp_path: Path) -> None:
    graph = tmp_path / "gspo_ref.py"
    graph.write_text(
        "from flowrl.graph import Graph\n\n\n"
        "def build(cfg):\n"
        "    g = Graph('gspo_ref')\n"
        "    g.model('actor', 'actor')\n"
        "    g.model('ref', 'reference', init_from='actor')\n"
        "    g.generate('rollout', model='actor', reads='prompts', writes='responses', n=4)\n"
        "    g.forward('old', model='actor', output='logprobs', reads='responses', writes='old_logprobs')\n"
        "    g.forward('ref', model='ref', output='logprobs', reads='responses', writes='ref_logprobs')\n"
        "    g.reward('reward', fn='task', reads='prompts responses', writes='rewards')\n"
        "    g.compute('adv', fn='grpo', reads='rewards responses', writes='advantages')\n"
        "    g.train('train', model='actor', loss='gspo', reads='responses old_logprobs ref_logprobs advantages')\n"
        "    return g\n"
    )
    with pytest.raises(PlanError, match="reads 'ref_logprobs', which loss 'gspo' does not use"):
        api.plan(str(graph), overrides=SMALL, emit=lambda s: None)
