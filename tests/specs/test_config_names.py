"""Run config names: `executor` (and `backend`, its older name), node options under `nodes`, the run
settings that are not plan content, and TOML on Python 3.10 (tomli)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from flowrl import api
from flowrl.errors import ConfigError
from flowrl.specs import RUN_SETTINGS, RunConfig, build_config, current_names, read_document

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------- executor, and backend its older name


def test_executor_is_the_field_and_backend_its_older_name() -> None:
    assert RunConfig().executor == "local" and "backend" not in RunConfig.__struct_fields__
    assert build_config({"executor": "ray"}).executor == "ray"
    assert build_config({"backend": "ray"}).executor == "ray"
    assert build_config({"backend": "ray", "executor": "ray"}).executor == "ray"  # both, agreeing


@pytest.mark.parametrize(
    ("layers", "want"),
    [
        (({"backend": "a"}, {"executor": "b"}), "b"),  # each layer is read as if it said executor; the later wins
        (({"executor": "a"}, {"backend": "b"}), "b"),
        (({"backend": "a"}, {}), "a"),
    ],
)
def test_backend_takes_the_precedence_of_its_layer(layers: tuple[dict, ...], want: str) -> None:
    assert build_config(*layers).executor == want


def test_a_layer_giving_both_names_differently_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"executor": "local", "backend": "ray"})
    message = str(info.value)
    assert "executor='local'" in message and "backend='ray'" in message and "give only executor" in message


def test_current_names_leaves_a_layer_without_older_names_alone() -> None:
    layer = {"seed": 1}
    assert current_names(layer) is layer
    assert current_names({"backend": "x", "seed": 1}) == {"executor": "x", "seed": 1}


def test_set_and_flags_accept_both_names(tmp_path: Path) -> None:
    for overrides, flags in (
        (["backend=local"], {}),
        (["executor=local"], {}),
        ([], {"backend": "local"}),
        ([], {"executor": "local"}),
    ):
        _, cfg = api.load("grpo", overrides=overrides, flags=flags)
        assert cfg.executor == "local"


def test_a_config_file_may_still_say_backend(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("backend: local\nseed: 3\n")
    _, cfg = api.load("grpo", config_file=read_document(path))
    assert cfg.executor == "local" and cfg.seed == 3


# ---------------------------------------------------------------------------- node options and run settings


def test_nodes_hold_option_overrides_per_node() -> None:
    assert RunConfig().nodes == {}
    cfg = build_config({"nodes": {"select": {"mode": "correct"}}}, {"nodes": {"select": {"k": 2}, "b": {"x": 1}}})
    assert cfg.nodes == {"select": {"mode": "correct", "k": 2}, "b": {"x": 1}}
    _, cfg = api.load("grpo", overrides=["nodes.advantages.eps=1e-4"])
    assert cfg.nodes == {"advantages": {"eps": 1e-4}}


def test_an_option_set_outside_nodes_says_where_node_options_go() -> None:
    with pytest.raises(ConfigError) as info:
        api.load("grpo", overrides=["select.mode=correct"])
    message = str(info.value)
    assert "unknown field 'select'" in message and "--set nodes.select.OPTION=VALUE" in message


def test_run_settings_are_config_fields() -> None:
    assert set(RUN_SETTINGS) <= set(RunConfig.__struct_fields__)
    assert set(RUN_SETTINGS) == {
        "out",
        "name",
        "save_every",
        "keep_checkpoints",
        "progress",
        "eval",
        "log",
        "trust_remote_code",
        "max_restarts",
        "replan_on_loss",
        "device_wait_s",
    }


# ---------------------------------------------------------------------------- TOML on Python 3.10


def test_toml_files_read_with_tomli_where_there_is_no_tomllib(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "run.toml"
    path.write_text("seed = 5\n[train]\nlr = 0.001\n")
    assert read_document(path) == {"seed": 5, "train": {"lr": 0.001}}
    fake = types.ModuleType("tomli")
    fake.loads = lambda text: {"read_by": "tomli"}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` fails, as on Python 3.10
    monkeypatch.setitem(sys.modules, "tomli", fake)
    assert read_document(path) == {"read_by": "tomli"}


def test_tomli_is_a_dependency_before_python_3_11_and_tomllib_is_imported_in_one_place() -> None:
    deps = read_document(ROOT / "pyproject.toml")["project"]["dependencies"]
    assert "tomli>=2; python_version<'3.11'" in deps
    importers = [
        p.relative_to(ROOT).as_posix()
        for where in ("flowrl", "plugins")
        for p in (ROOT / where).rglob("*.py")
        if "import tomllib" in p.read_text()
    ]
    assert importers == ["flowrl/specs.py"], importers
