"""Run config specs: layering, --set parsing, file reading, validation errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowrl import api
from flowrl.errors import ConfigError
from flowrl.plugins.manager import load_plugins
from flowrl.specs import RunConfig, build_config, merge, nested, parse_override, read_document, to_builtins

# ---------------------------------------------------------------------------- layering


def test_defaults_are_the_struct_defaults() -> None:
    assert build_config() == RunConfig()
    assert build_config({}, {}) == RunConfig()


def test_later_layers_win_and_merge_deeply() -> None:
    defaults = {"seed": 1, "steps": 10, "train": {"lr": 0.1, "epochs": 2}, "rollout": {"prompts_per_step": 64}}
    file = {"seed": 2, "train": {"epochs": 3}}
    overrides = {"seed": 3, "train": {"grad_clip": 0.5}}
    flags = {"seed": 4}
    cfg = build_config(defaults, file, overrides, flags)
    assert cfg.seed == 4
    assert cfg.steps == 10  # only in defaults
    assert cfg.train.lr == 0.1  # defaults, untouched by the file's train mapping
    assert cfg.train.epochs == 3  # the file beats the defaults
    assert cfg.train.grad_clip == 0.5
    assert cfg.rollout.prompts_per_step == 64
    assert cfg.rollout.samples_per_prompt == RunConfig().rollout.samples_per_prompt


def test_make_config_precedence_defaults_file_set_flags() -> None:
    defaults = {"seed": 1, "steps": 1, "out": "d", "train": {"lr": 0.5}}
    file = {"seed": 2, "steps": 2, "out": "f", "train": {"lr": 0.25, "epochs": 2}}
    cfg = api.make_config(defaults, file, ["seed=3", "steps=3", "train.lr=1e-3"], {"seed": 4, "out": None})
    assert (cfg.seed, cfg.steps, cfg.out) == (4, 3, "f")  # flag None does not override
    assert cfg.train.lr == 1e-3 and cfg.train.epochs == 2
    # later --set beats earlier --set
    assert api.make_config({}, None, ["seed=5", "seed=6"]).seed == 6


def test_graph_defaults_are_the_lowest_layer() -> None:
    from flowrl.graphs.ppo import DEFAULTS

    registry = load_plugins(entry_points=False)[1]
    _, cfg = api.load("ppo", registry=registry)
    samples = DEFAULTS["rollout"]["samples_per_prompt"]
    assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt) == (
        DEFAULTS["rollout"]["prompts_per_step"],
        samples,
    )
    _, cfg = api.load(
        "ppo",
        registry=registry,
        config_file={"rollout": {"prompts_per_step": 16}, "seed": 1},
        overrides=["rollout.prompts_per_step=8", "seed=2"],
        flags={"seed": 3},
    )
    assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.seed) == (8, samples, 3)


def test_merge_and_nested_do_not_mutate() -> None:
    base = {"a": {"b": 1, "c": 2}}
    out = merge(base, {"a": {"b": 3}, "d": 4})
    assert out == {"a": {"b": 3, "c": 2}, "d": 4}
    assert base == {"a": {"b": 1, "c": 2}}
    # a non-mapping replaces a mapping (and vice versa)
    assert merge({"a": {"b": 1}}, {"a": 5}) == {"a": 5}
    assert nested(["x", "y", "z"], 1) == {"x": {"y": {"z": 1}}}


# ---------------------------------------------------------------------------- --set parsing


@pytest.mark.parametrize(
    ("text", "path", "value"),
    [
        ("train.lr=1e-3", ["train", "lr"], 0.001),
        ("train.lr=-2E-4", ["train", "lr"], -0.0002),
        ("train.lr=3e+2", ["train", "lr"], 300.0),
        ("train.lr=0.5", ["train", "lr"], 0.5),
        ("steps=10", ["steps"], 10),
        ("checkpoint=false", ["checkpoint"], False),
        ("progress=true", ["progress"], True),
        ("task=copy", ["task"], "copy"),
        ("name=1-3", ["name"], "1-3"),
        ("train.betas=[0.8, 0.9]", ["train", "betas"], [0.8, 0.9]),
        ("model=null", ["model"], None),
        ("out=", ["out"], ""),
        ("task_options.sep=a=b", ["task_options", "sep"], "a=b"),
        (" train.lr = 1e-3", ["train", "lr"], 0.001),
    ],
)
def test_parse_override(text: str, path: list[str], value: object) -> None:
    got_path, got = parse_override(text)
    assert got_path == path
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["train.lr", "=3", ".=3"])
def test_parse_override_rejects_malformed(text: str) -> None:
    with pytest.raises(ConfigError, match="--set"):
        parse_override(text)


def test_override_into_config_converts_types() -> None:
    cfg = api.make_config(
        {}, None, ["train.lr=1e-3", "train.betas=[0.8, 0.9]", "algo.kl_estimator=k1", "checkpoint=no"]
    )
    assert cfg.train.lr == 0.001
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.algo.kl_estimator == "k1"
    assert cfg.checkpoint is False


# ---------------------------------------------------------------------------- validation errors


def _names_path(message: str, path: str) -> bool:
    """The dotted path appears as one quoted token (`a.b` or 'a.b')."""
    return re.search(rf"[`']{re.escape(path)}[`']", message) is not None


def test_unknown_field_names_the_full_path() -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"train": {"lrr": 1}})
    assert _names_path(str(info.value), "train.lrr"), str(info.value)
    with pytest.raises(ConfigError) as info:
        build_config({"rollout": {"top_k": 5}})
    assert _names_path(str(info.value), "rollout.top_k"), str(info.value)


def test_unknown_field_mentions_field_and_section() -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"train": {"lrr": 1}})
    assert "lrr" in str(info.value) and "train" in str(info.value)
    with pytest.raises(ConfigError, match="bogus"):
        api.make_config({}, None, ["bogus=1"])


@pytest.mark.parametrize(
    ("layer", "path"),
    [
        ({"train": {"lr": "fast"}}, "train.lr"),
        ({"rollout": {"prompts_per_step": 1.5}}, "rollout.prompts_per_step"),
        ({"algo": {"kl_estimator": "k9"}}, "algo.kl_estimator"),
        ({"steps": "many"}, "steps"),
        ({"train": 3}, "train"),
    ],
)
def test_wrong_type_names_the_path(layer: dict, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(layer)
    assert _names_path(str(info.value), path), str(info.value)
    assert "$." not in str(info.value)


@pytest.mark.parametrize(
    ("layer", "field"),
    [
        ({"rollout": {"top_p": 0}}, "rollout.top_p"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p"),
        ({"rollout": {"temperature": 0}}, "rollout.temperature"),
        ({"rollout": {"prompts_per_step": 0}}, "rollout.prompts_per_step"),
        ({"rollout": {"samples_per_prompt": 0}}, "rollout.samples_per_prompt"),
        ({"train": {"lr": 0}}, "train.lr"),
        ({"train": {"epochs": 0}}, "train.epochs"),
        ({"train": {"mini_batches": 0}}, "train.mini_batches"),
        ({"train": {"micro_batch_size": 0}}, "train.micro_batch_size"),
        ({"steps": -1}, "steps"),
        ({"threads": -1}, "threads"),
        ({"seed": 2**67}, "seed"),
        ({"seed": -5}, "seed"),
        ({"rollout": {"temperature": float("inf")}}, "rollout.temperature"),
        ({"train": {"lr": float("nan")}}, "train.lr"),
        ({"train": {"betas": [2, -1]}}, "train.betas"),
        ({"train": {"grad_clip": -1}}, "train.grad_clip"),
        ({"train": {"weight_decay": -5}}, "train.weight_decay"),
        ({"train": {"critic_lr": 0}}, "train.critic_lr"),
        ({"algo": {"clip_low": -1}}, "algo.clip_low"),
        ({"algo": {"clip_high": 0}}, "algo.clip_high"),
        ({"algo": {"dual_clip": 1.0}}, "algo.dual_clip"),
        ({"algo": {"kl_coef": -0.1}}, "algo.kl_coef"),
        ({"algo": {"gamma": 1.5}}, "algo.gamma"),
        ({"algo": {"lam": -0.1}}, "algo.lam"),
        ({"algo": {"vf_clip": 0}}, "algo.vf_clip"),
        ({"algo": {"vf_coef": -1}}, "algo.vf_coef"),
        ({"algo": {"is_cap": float("inf")}}, "algo.is_cap"),
        ({"rollout": {"staleness": -1}}, "rollout.staleness"),
        ({"rollout": {"chunk_tokens": 0}}, "rollout.chunk_tokens"),
        ({"name": "../x"}, "name"),
        ({"name": ".."}, "name"),
        ({"name": "a/b"}, "name"),
    ],
)
def test_range_checks_name_the_field(layer: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"config field '{field}'"):
        build_config(layer)


def test_range_boundaries_are_accepted() -> None:
    cfg = build_config(
        {
            "rollout": {"top_p": 1.0, "prompts_per_step": 1, "samples_per_prompt": 1},
            "steps": 0,
            "train": {"micro_batch_size": 1},
        }
    )
    assert cfg.rollout.top_p == 1.0 and cfg.steps == 0


def test_to_builtins_round_trips() -> None:
    cfg = build_config({"train": {"lr": 0.01}, "task_options": {"digits": 2}})
    assert build_config(to_builtins(cfg)) == cfg


# ---------------------------------------------------------------------------- files


def test_read_yaml_toml_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("seed: 3\ntrain:\n  lr: 1.0e-3\n")
    toml_file = tmp_path / "c.toml"
    toml_file.write_text("seed = 3\n[train]\nlr = 1e-3\n")
    json_file = tmp_path / "c.json"
    json_file.write_text('{"seed": 3, "train": {"lr": 0.001}}')
    yml_file = tmp_path / "c.yml"
    yml_file.write_text("seed: 3\ntrain: {lr: 0.001}\n")
    for path in (yaml_file, toml_file, json_file, yml_file):
        doc = read_document(path)
        assert doc == {"seed": 3, "train": {"lr": 0.001}}, path
        assert build_config(doc).train.lr == 0.001


def test_empty_yaml_is_an_empty_mapping(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert read_document(path) == {}


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_document(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("name", "text", "fmt"),
    [
        ("bad.yaml", "seed: [1, 2\n", "YAML"),
        ("bad.toml", "seed = = 3\n", "TOML"),
        ("bad.json", '{"seed": 3,,}', "JSON"),
    ],
)
def test_bad_syntax(tmp_path: Path, name: str, text: str, fmt: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"is not valid {fmt}") as info:
        read_document(path)
    assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "text", "found"),
    [("list.yaml", "- 1\n- 2\n", "list"), ("num.json", "3", "int"), ("s.yaml", "hello\n", "str")],
)
def test_top_level_must_be_a_mapping(tmp_path: Path, name: str, text: str, found: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"mapping at the top level, found {found}"):
        read_document(path)


def test_unknown_suffix(tmp_path: Path) -> None:
    path = tmp_path / "c.ini"
    path.write_text("[x]\n")
    with pytest.raises(ConfigError, match="unknown format '.ini'"):
        read_document(path)


def test_yaml_never_executes_tags(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("seed: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        read_document(path)


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ""])
def test_a_graph_name_that_would_leave_the_run_folder_is_refused(name: str) -> None:
    from flowrl.errors import GraphError
    from flowrl.graph import Graph

    with pytest.raises(GraphError, match="plain folder name"):
        Graph(name)
