"""ExecutionPlan: JSON/YAML round trips, content-hash ids, refusing edited plans."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import yaml

from flowrl import api
from flowrl.contract.plan import ExecutionPlan, dump_plan, encode_plan, load_plan
from flowrl.errors import ConfigError
from flowrl.plugins.manager import load_plugins


@pytest.fixture(scope="module")
def plan() -> ExecutionPlan:
    registry = load_plugins(entry_points=False)[1]
    _, p = api.plan(
        "ppo",
        registry=registry,
        overrides=[
            "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=2",
            "train.lr=1e-7",
            "memory_limit_gib=8",
            "task_options={}",
        ],
        emit=lambda _: None,
    )
    return p


def test_plan_is_sealed_with_its_content_hash(plan: ExecutionPlan) -> None:
    assert plan.id and len(plan.id) == 16
    assert plan.id == plan.content_id()
    assert plan.sealed() == plan
    # the id field itself is not part of the hash
    assert msgspec.structs.replace(plan, id="0" * 16).content_id() == plan.id


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_round_trip_through_files(plan: ExecutionPlan, tmp_path: Path, suffix: str) -> None:
    path = dump_plan(plan, tmp_path / "nested" / f"plan{suffix}")
    assert path.is_file()
    back = load_plan(path)
    assert back == plan
    assert back.id == plan.id
    assert back.config.train.betas == plan.config.train.betas  # tuple, not list
    assert back.config.train.lr == 1e-7


def test_json_and_yaml_files_hold_the_same_document(plan: ExecutionPlan, tmp_path: Path) -> None:
    j = json.loads(dump_plan(plan, tmp_path / "p.json").read_text())
    y = yaml.safe_load(dump_plan(plan, tmp_path / "p.yaml").read_text())
    assert j == y
    assert j["id"] == plan.id
    assert [n["node"] for n in j["nodes"]] == [n.node for n in plan.nodes]
    assert yaml.safe_load(encode_plan(plan)) == j
    assert json.loads(encode_plan(plan, "json")) == j


def test_id_changes_when_any_field_changes(plan: ExecutionPlan) -> None:
    ids = {plan.id}
    changes = [
        {"config": msgspec.structs.replace(plan.config, seed=plan.config.seed + 1)},
        {"config": msgspec.structs.replace(plan.config, executor="other")},
        {
            "target": msgspec.structs.replace(
                plan.target, numerics=msgspec.structs.replace(plan.target.numerics, weight_bytes=2)
            )
        },
        {"layout": msgspec.structs.replace(plan.layout, placement="split")},
        {"passes": plan.passes[:-1]},
        {"nodes": (msgspec.structs.replace(plan.nodes[0], micro_batch_size=1), *plan.nodes[1:])},
        {"graph": msgspec.structs.replace(plan.graph, fingerprint="0" * 16)},
    ]
    for change in changes:
        ids.add(msgspec.structs.replace(plan, **change).content_id())
    assert len(ids) == len(changes) + 1


def test_hand_edited_plan_is_refused(plan: ExecutionPlan, tmp_path: Path) -> None:
    path = dump_plan(plan, tmp_path / "plan.yaml")
    text = path.read_text()
    assert "  seed: 0\n" in text
    path.write_text(text.replace("  seed: 0\n", "  seed: 1\n"))
    with pytest.raises(ConfigError) as info:
        load_plan(path)
    message = str(info.value)
    assert "edited" in message and plan.id in message and str(path) in message


def test_edit_is_accepted_when_the_id_line_is_removed(plan: ExecutionPlan, tmp_path: Path) -> None:
    path = dump_plan(plan, tmp_path / "plan.yaml")
    lines = path.read_text().splitlines(keepends=True)
    edited = [line.replace("  seed: 0\n", "  seed: 1\n") for line in lines if not line.startswith("id:")]
    assert len(edited) == len(lines) - 1
    path.write_text("".join(edited))
    back = load_plan(path)
    assert back.config.seed == 1
    assert back.id == back.content_id() != plan.id
    # every 'seed: 0' line was edited: the config's and each model's resolved run spec (what engines build with)
    models = {m: msgspec.structs.replace(run, seed=1) for m, run in plan.models.items()}
    edited_plan = msgspec.structs.replace(plan, config=msgspec.structs.replace(plan.config, seed=1), models=models)
    assert back == edited_plan.sealed()


def test_json_edit_refused_then_accepted_without_id(plan: ExecutionPlan, tmp_path: Path) -> None:
    path = dump_plan(plan, tmp_path / "plan.json")
    doc = json.loads(path.read_text())
    doc["nodes"][0]["micro_batch_size"] = 1
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="edited after it was planned"):
        load_plan(path)
    del doc["id"]
    path.write_text(json.dumps(doc))
    back = load_plan(path)
    assert back.nodes[0].micro_batch_size == 1 and back.id == back.content_id()


def test_unknown_plan_field_and_bad_suffix(plan: ExecutionPlan, tmp_path: Path) -> None:
    path = dump_plan(plan, tmp_path / "plan.json")
    doc = json.loads(path.read_text())
    doc["extra_field"] = 1
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="extra_field"):
        load_plan(path)
    with pytest.raises(ConfigError, match=r"\.yaml or \.json"):
        dump_plan(plan, tmp_path / "plan.txt")
    with pytest.raises(ConfigError, match="does not exist"):
        load_plan(tmp_path / "missing.yaml")


def test_node_lookup(plan: ExecutionPlan) -> None:
    assert plan.node("gae").kind == "compute"
    with pytest.raises(KeyError):
        plan.node("nope")
