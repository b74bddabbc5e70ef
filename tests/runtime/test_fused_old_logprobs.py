"""A policy taking one update per batch trains on the weights that computed its old log-probs: the
plan fuses the old-log-prob forward into the train node (``plan.fused``), which computes them in its
own forward, detached. Same update, one forward pass fewer: with LoRA, packing and one-step-off
generation, with streaming scoring and partial rollouts; a fused run still reports the sampler's
log-prob gap, and `verify_plan` refuses a fusion the graph's structure does not allow. (A plugin
engine that declares no own outputs stays unfused: tests/runtime/test_runtime_boundary.py.)"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from safetensors.torch import load_file

from flowrl import api
from flowrl.contract.plan import load_plan
from flowrl.errors import PlanError
from flowrl.graph import Graph
from flowrl.planner.passes import verify_plan
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
    ("sets", "fused"),
    [
        (("train.mini_batches=2",), {}),  # two updates: the second's old log-probs are not its weights'
        (("train.epochs=2",), {}),
        (("nodes.train_actor.epochs=2",), {}),
        (("nodes.train_actor.mini_batches=2",), {}),
        # a node's own options decide, over the config's
        (("train.mini_batches=2", "nodes.train_actor.mini_batches=1"), {"old_logprobs": "train_actor"}),
        (("train.epochs=3", "nodes.train_actor.epochs=1"), {"old_logprobs": "train_actor"}),
        (("algo.kl_coef=0",), {"old_logprobs": "train_actor"}),  # no reference model: still fused
    ],
)
def test_one_update_per_batch_decides_the_fusion_and_an_unfused_train_waits_on_the_forward(sets, fused):
    g, plan = _plan("grpo", *sets)
    assert plan.fused == fused
    tasks = {t.name: t for t in lower(g, plan).tasks}
    assert ("old_logprobs" in tasks) == (not fused)
    if not fused:
        assert "old_logprobs" in tasks["train_actor"].deps


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


@pytest.mark.slow
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


def test_explain_says_what_is_fused_and_prices_no_pass_for_it(capsys):
    from flowrl.cli import main

    assert main(["plan", "grpo", *[a for s in TINY[1:] for a in ("--set", s)], "--explain"]) == 0
    out = capsys.readouterr().out
    assert "fused: 'old_logprobs' is computed by 'train_actor' in its own forward" in out
    per_node = out.split("per node", 1)[1].split("device groups", 1)[0]
    assert "train_actor" in per_node and "old_logprobs" not in per_node


def test_a_plan_fusing_another_models_forward_is_refused():
    g, p = _plan("grpo")
    assert "ref_logprobs" in g.nodes
    edited = msgspec.structs.replace(p, fused={**p.fused, "ref_logprobs": "train_actor"}).sealed()
    with pytest.raises(PlanError, match="ref_logprobs"):
        verify_plan(g, edited)


def test_a_stale_fusion_in_a_plan_of_two_updates_per_batch_is_refused():
    g, p = _plan("grpo", "train.mini_batches=2")
    assert p.fused == {} and p.options["train_actor"].options["mini_batches"] == 2
    edited = msgspec.structs.replace(p, fused={"old_logprobs": "train_actor"}).sealed()
    with pytest.raises(PlanError, match="old_logprobs"):
        verify_plan(g, edited)


def unfused(p, out: Path):
    """The same plan with the fusion taken out, to run in ``out``."""
    return msgspec.structs.replace(p, fused={}).with_run_settings({"out": str(out)})


@pytest.fixture(scope="module")
def fused_run(tmp_path_factory):
    """One fused GRPO run of two steps (with its reference model: algo.kl_coef > 0)."""
    g, p = _plan("grpo")
    assert p.fused == {"old_logprobs": "train_actor"}
    out = tmp_path_factory.mktemp("fused")
    return g, p, api.run(g, p.with_run_settings({"out": str(out)}))


@pytest.mark.slow
def test_a_fused_run_has_no_old_logprob_pass_but_trains_on_the_ratio_one(fused_run):
    _, _, result = fused_run
    for record in result.metrics:
        assert "old_logprobs" not in record["spans"] and "train_actor" in record["spans"]
        assert not any(k.startswith("old_logprobs/") for k in record)
        # its old log-probs are its own, detached: on-policy the PPO ratio is exactly one
        assert record["train_actor/ratio_mean"] == 1.0 and record["train_actor/clipfrac"] == 0.0


def test_a_fused_run_still_reports_the_sampler_vs_trainer_logprob_gap(fused_run):
    _, _, result = fused_run
    assert all(isinstance(r.get("logprob_gap"), float) for r in result.metrics)


@pytest.mark.slow
def test_fused_equals_separate_forward_with_lora_packing_and_one_step_off(tmp_path):
    """One update per batch on LoRA adapters, packed micro-batches under a token budget, generation one
    step ahead: the fused step trains as the separate forward did (same samples, same weights)."""
    sets = ("train.lora.rank=4", "train.pack=true", "train.max_tokens_per_micro_batch=48", "rollout.mode=one_step_off")
    g, p = _plan("grpo", *sets, "steps=3")
    assert p.fused == {"old_logprobs": "train_actor"}
    a = api.run(g, p.with_run_settings({"out": str(tmp_path / "fused")}))
    sep = unfused(p, tmp_path / "separate")
    b = api.run(api.graph_for_plan(sep), sep)
    assert [r["reward"] for r in a.metrics] == [r["reward"] for r in b.metrics]
    for ra, rb in zip(a.metrics, b.metrics, strict=True):
        assert ra["train_actor/loss"] == pytest.approx(rb["train_actor/loss"], abs=1e-5)
        assert ra["train_actor/is_mean"] == pytest.approx(rb["train_actor/is_mean"], abs=1e-5)
    assert a.metrics[1]["train_actor/offpolicy_frac"] > 0  # one step off: the behaviour policy is older
    wa = load_file(str(a.checkpoints["actor"] / "model.safetensors"))
    wb = load_file(str(b.checkpoints["actor"] / "model.safetensors"))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5


@pytest.mark.parametrize("mode", ["streaming", "partial+async"])
@pytest.mark.slow
def test_fused_equals_separate_forward_when_scoring_streams_or_rollouts_continue(tmp_path, mode):
    """Streaming starts scoring forward nodes on parts of the responses (the fused forward is one of
    them, with no task); partial rollouts continue responses across steps."""
    g, p = _plan("grpo", f"rollout.mode={mode}", "checkpoint=false")
    assert p.fused == {"old_logprobs": "train_actor"}
    a = api.run(g, p.with_run_settings({"out": str(tmp_path / "fused")}))
    sep = unfused(p, tmp_path / "separate")
    b = api.run(api.graph_for_plan(sep), sep)
    for ra, rb in zip(a.metrics, b.metrics, strict=True):
        assert ra["reward"] == rb["reward"]
        assert ra["train_actor/loss"] == pytest.approx(rb["train_actor/loss"], abs=1e-5)
        assert ra["train_actor/grad_norm"] == pytest.approx(rb["train_actor/grad_norm"], rel=1e-4)
        assert "old_logprobs" not in ra["spans"] and "old_logprobs" in rb["spans"]
