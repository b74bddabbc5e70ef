"""Checkpoints and exact resume: a seeded run stopped after a checkpoint and resumed produces the
same metrics, bit for bit, as the run that was never stopped, in every rollout mode; what a
checkpoint holds is safetensors and JSON only; non-finite values stop (or skip) a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl import api
from flowrl.contract.plan import load_plan
from flowrl.errors import BackendError, ConfigError, FlowRLError, GraphError
from flowrl.runtime import checkpoint
from flowrl.runtime.executor import run_dir

SMALL = ["progress=false", "rollout.prompts_per_step=4", "save_every=2"]
TIMING = ("step_seconds", "tokens_per_s", "spans")


class Crash(Exception):
    pass


def _metrics(folder: Path) -> list[dict]:
    out = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.append({k: v for k, v in record.items() if k not in TIMING and not k.endswith("/seconds")})
    return out


def _crash_at(step: int):
    def on_step(record: dict) -> None:
        if record["step"] == step:
            raise Crash

    return on_step


def _stopped_and_resumed(graph, plan, folder: Path, crash: int) -> api.RunResult:
    with pytest.raises(Crash):
        api.run(graph, plan, out_dir=folder, on_step=_crash_at(crash))
    return api.run(graph, load_plan(folder / "plan.yaml"), out_dir=folder, resume=True)


@pytest.mark.parametrize(
    "algo,mode",
    # (more algorithms and modes: test_resume_edge_cases.py)
    [("grpo", "sync"), ("grpo", "one_step_off"), ("ppo", "partial+async")],
)
@pytest.mark.slow
def test_a_resumed_run_equals_the_uninterrupted_run_bit_for_bit(tmp_path, algo, mode):
    graph, plan = api.plan(algo, overrides=[*SMALL, f"rollout.mode={mode}"], flags={"steps": 7}, emit=lambda s: None)
    whole = run_dir(str(tmp_path), "whole")
    api.run(graph, plan, out_dir=whole)
    part = run_dir(str(tmp_path), "part")
    # checkpoints after steps 1, 3, 5, 6; the crash after step 4 loses step 4, which is run again
    result = _stopped_and_resumed(graph, plan, part, crash=4)
    assert result.resumed_from == 4
    a, b = _metrics(whole), _metrics(part)
    assert [r["step"] for r in b] == list(range(7))  # no gap, no duplicate
    assert a == b
    assert b[-1]["prompts_drawn"] == a[-1]["prompts_drawn"] > 0
    # the final HF checkpoints are the same weights
    from safetensors.torch import load_file

    wa, wb = (load_file(str(f / "checkpoint" / "model.safetensors")) for f in (whole, part))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_a_checkpoint_is_safetensors_and_json_and_the_newest_k_are_kept(tmp_path):
    graph, plan = api.plan(
        "ppo", overrides=[*SMALL, "save_every=1", "keep_checkpoints=2"], flags={"steps": 4}, emit=lambda s: None
    )
    result = api.run(graph, plan, out_dir=run_dir(str(tmp_path), "k"))
    found = checkpoint.listed(result.out_dir)
    assert [step for step, _ in found] == [2, 3]
    latest = found[-1][1]
    suffixes = {p.suffix for p in latest.rglob("*") if p.is_file()}
    assert suffixes <= {".json", ".safetensors"}, suffixes  # no pickle anywhere
    models = {p.name for p in (latest / "models").iterdir()}
    assert models == {"actor", "critic"}  # every trainable model; the frozen reference is rebuilt
    state = json.loads((latest / "state.json").read_text())
    assert state["step"] == 3 and set(state["models"]) == models
    assert (latest / "models" / "actor" / "optimizer.safetensors").stat().st_size > 0
    assert not list((result.out_dir / "checkpoints").glob(".tmp-*"))
    # the final HF checkpoint is the last step's model folder
    assert (result.out_dir / "checkpoint" / "model.safetensors").read_bytes() == (
        latest / "models" / "actor" / "model.safetensors"
    ).read_bytes()


def test_an_interrupted_checkpoint_write_leaves_the_previous_one_latest(tmp_path):
    run = tmp_path / "run"
    with checkpoint.atomic_dir(checkpoint.step_dir(run, 1)) as tmp:
        (tmp / checkpoint.STATE).write_text("{}")
    with pytest.raises(KeyboardInterrupt):
        with checkpoint.atomic_dir(checkpoint.step_dir(run, 3)) as tmp:
            (tmp / "half").write_text("x")
            raise KeyboardInterrupt
    # a kill -9 leaves the temporary folder behind: it is never a checkpoint
    (run / "checkpoints" / ".tmp-step-000005-999").mkdir()
    assert checkpoint.latest(run) == (1, checkpoint.step_dir(run, 1))
    checkpoint.prune(run, keep=5)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000001"]


def test_the_tree_codec_round_trips_and_builds_only_known_types(tmp_path):
    from flowrl.contract.data import Prompt

    tree = {
        0: (torch.arange(3), [1.5, float("nan"), None, "x"]),
        "p": Prompt(text="ab>", answer="ab"),
        "same": torch.ones(2)[:1],  # a view: stored apart
    }
    checkpoint.save_tree(tmp_path / "t", tree)
    back = checkpoint.load_tree(tmp_path / "t")
    assert torch.equal(back[0][0], torch.arange(3)) and back[0][1][0] == 1.5 and back[0][1][1] != back[0][1][1]
    assert back["p"] == Prompt(text="ab>", answer="ab") and isinstance(back[0], tuple)
    (tmp_path / "t.json").write_text(json.dumps({"$type": "Popen", "fields": {}}))
    with pytest.raises(ConfigError, match="t.json"):
        checkpoint.load_tree(tmp_path / "t")


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_run_and_a_corrupt_one(tmp_path):
    graph, plan = api.plan("grpo", overrides=SMALL, flags={"steps": 2}, emit=lambda s: None)
    folder = api.run(graph, plan, out_dir=run_dir(str(tmp_path), "a")).out_dir
    state = checkpoint.latest(folder)[1] / checkpoint.STATE
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({**saved, "seed": 99}))
    with pytest.raises(ConfigError, match="not this run's checkpoint"):
        api.run(graph, plan, out_dir=folder, resume=True)
    state.write_text(json.dumps(saved))
    (state.parent / "driver.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ConfigError, match="driver"):
        api.run(graph, plan, out_dir=folder, resume=True)


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_starts_over_on_resume(tmp_path):
    graph, plan = api.plan("grpo", overrides=[*SMALL, "save_every=0"], flags={"steps": 3}, emit=lambda s: None)
    folder = run_dir(str(tmp_path), "a")
    with pytest.raises(Crash):
        api.run(graph, plan, out_dir=folder, on_step=_crash_at(0))
    assert (folder / "metrics.jsonl").read_text().count("\n") == 1  # a step completed: the folder stays
    result = api.run(graph, plan, out_dir=folder, resume=True)
    assert result.resumed_from == 0 and [r["step"] for r in _metrics(folder)] == [0, 1, 2]


def test_a_run_failing_before_any_step_leaves_no_folder(tmp_path):
    import msgspec

    graph, plan = api.plan("grpo", overrides=SMALL, flags={"steps": 2}, emit=lambda s: None)
    bad = msgspec.structs.replace(plan, config=msgspec.structs.replace(plan.config, task="no-such-task"))
    folder = run_dir(str(tmp_path), "a")
    with pytest.raises(FlowRLError, match="no-such-task"):
        api.run(graph, bad, out_dir=folder)
    assert not folder.exists()


@pytest.mark.slow
def test_a_non_finite_advantage_stops_the_step_naming_the_node_or_is_skipped(tmp_path, monkeypatch):
    graph, plan = api.plan("grpo", overrides=SMALL, flags={"steps": 2}, emit=lambda s: None)
    estimator = next(n for n in graph.nodes.values() if n.kind == "compute")
    entry = next(e for e in api.default_registry().entries("compute_functions") if e.name == estimator.fn)
    original = entry.obj

    def poisoned(batch, algo, **options):
        out = original(batch, algo, **options)
        out, metrics = out if isinstance(out, tuple) else (out, {})
        return {k: v * float("nan") if isinstance(v, torch.Tensor) else v for k, v in out.items()}, metrics

    from dataclasses import replace

    from flowrl.plugins.manager import Registry

    entries = Registry.entries
    monkeypatch.setattr(
        Registry,
        "entries",
        lambda self, kind: [replace(e, obj=poisoned) if e is entry else e for e in entries(self, kind)],
    )
    folder = run_dir(str(tmp_path), "a")
    with pytest.raises(GraphError, match=rf"node '{estimator.name}'.*non-finite"):
        api.run(graph, plan, out_dir=folder)
    assert not folder.exists()  # nothing completed, nothing left behind
    graph, plan = api.plan(
        "grpo", overrides=[*SMALL, "train.skip_nonfinite=true"], flags={"steps": 2}, emit=lambda s: None
    )
    result = api.run(graph, plan, out_dir=run_dir(str(tmp_path), "b"))
    train = next(n for n in graph.nodes.values() if n.kind == "train")
    assert all(r[f"{train.name}/skipped"] >= 1 for r in result.metrics)
    # the weights never saw the NaN: the checkpoint was written and is finite
    from safetensors.torch import load_file

    weights = load_file(str(result.out_dir / "checkpoint" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_a_poisoned_model_is_never_checkpointed(tmp_path):
    graph, plan = api.plan("grpo", overrides=SMALL, flags={"steps": 1}, emit=lambda s: None)
    ex = api.check(graph, plan)
    trainers, _ = ex.engines(graph, plan)
    actor = trainers["actor"]
    with torch.no_grad():
        next(actor.module.parameters()).fill_(float("inf"))
    with pytest.raises(BackendError, match="non-finite weights"):
        actor.save_state(tmp_path / "actor")
