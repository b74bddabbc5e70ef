"""A policy taking one update per batch trains on the weights that computed its old log-probs: the
plan fuses the old-log-prob forward into the train node (``plan.fused``), which computes them in its
own forward, detached. Same update, one forward pass fewer."""

from __future__ import annotations

import msgspec
import pytest
from safetensors.torch import load_file

from flowrl import api
from flowrl.graph import Graph
from flowrl.planner.plan import load_plan
from flowrl.runtime.schedule import lower

TINY = [
    "steps=2",
    "seed=1",  # a seed whose first batches have non-constant rewards (an update; seeds 0 and 2: none yet)
    "progress=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.mini_batches=1",
    "train.micro_batch_size=5",
]


def _plan(graph: str | Graph, *sets: str):
    return api.plan(graph, overrides=[*TINY, *sets], emit=lambda s: None)


def test_one_update_per_batch_fuses_the_old_logprobs_and_the_schedule_drops_their_pass():
    g, plan = _plan("grpo")
    assert plan.fused == {"old_logprobs": "train_actor"}
    tasks = {t.name: t for t in lower(g, plan).tasks}
    assert "old_logprobs" not in tasks
    assert "rollout" in tasks["train_actor"].deps  # what the fused forward waited for, the train waits for


@pytest.mark.parametrize(
    "sets",
    [
        ("train.mini_batches=2",),  # two updates: the second's old log-probs are not its weights'
        ("train.epochs=2",),
        ("nodes.train_actor.epochs=2",),
    ],
)
def test_more_than_one_update_per_batch_keeps_the_forward(sets):
    g, plan = _plan("grpo", *sets)
    assert plan.fused == {}
    assert "old_logprobs" in {t.name for t in lower(g, plan).tasks}


@pytest.mark.parametrize(
    ("graph", "fused"),
    [
        ("ppo", {}),  # GAE reads the old log-probs too
        ("rloo", {"old_logprobs": "train_actor"}),
        ("dapo", {"old_logprobs": "train_actor"}),  # after its dynamic-sampling filter: once per step
        (
            "two_agent",  # two policies, each fused into its own train node (ports rename the key)
            {"solver_logprobs": "train_solver", "proposer_logprobs": "train_proposer"},
        ),
    ],
)
def test_what_is_fused_in_the_shipped_graphs(graph, fused):
    _, plan = _plan(graph)
    assert plan.fused == fused


def test_a_plan_without_fusion_keeps_its_id_and_an_edited_fusion_is_refused(tmp_path):
    _, plan = _plan("grpo", "train.mini_batches=2")
    body = msgspec.to_builtins(plan)
    assert "fused" in body and body["fused"] == {}
    plain = msgspec.structs.replace(plan, fused={}).sealed()
    assert plain.id == plan.id  # an empty fusion is not part of the id (plans written before it keep theirs)
    _, fused = _plan("grpo")
    path = tmp_path / "p.yaml"
    text = msgspec.yaml.encode(fused).decode().replace("old_logprobs: train_actor", "old_logprobs: rollout")
    path.write_text(text)
    with pytest.raises(Exception, match="edited"):
        load_plan(path)


def test_the_fused_step_equals_the_separate_forward_step(tmp_path):
    """Two steps of the same run with and without the fusion: the same samples, rewards and (up to
    float noise between a batch's forward and its micro-batches) the same updated weights."""
    g, fused = _plan("grpo", f"out={tmp_path / 'fused'}")
    assert fused.fused
    separate = msgspec.structs.replace(fused, fused={}).with_run_settings({"out": str(tmp_path / "separate")})
    a = api.run(g, fused)
    b = api.run(api.graph_for_plan(separate), separate)
    for ra, rb in zip(a.metrics, b.metrics, strict=True):
        assert ra["reward"] == rb["reward"]
        assert ra["train_actor/loss"] == pytest.approx(rb["train_actor/loss"], abs=1e-5)
        assert ra["train_actor/clipfrac"] == rb["train_actor/clipfrac"] == 0.0
    assert "old_logprobs" not in a.metrics[0]["spans"] and "old_logprobs" in b.metrics[0]["spans"]
    wa = load_file(str(a.checkpoints["actor"] / "model.safetensors"))
    wb = load_file(str(b.checkpoints["actor"] / "model.safetensors"))
    assert all(r["train_actor/grad_norm"] > 0.1 for r in a.metrics)  # an update (AdamW moves weights ~lr=2e-3)
    for k in wa:
        assert float((wa[k] - wb[k]).abs().max()) < 1e-5, k


def test_fused_old_logprobs_reach_a_loss_under_its_port_name(tmp_path):
    """two_agent binds each policy's old log-probs to the ppo loss's ``old_logprobs`` port."""
    g, plan = _plan("two_agent", "steps=1", f"out={tmp_path}")
    assert len(plan.fused) == 2
    record = api.run(g, plan).metrics[-1]
    for node in ("train_solver", "train_proposer"):
        assert record[f"{node}/grad_norm"] >= 0 and record[f"{node}/clipfrac"] == 0.0  # its own: ratio 1
