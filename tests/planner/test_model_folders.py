"""A folder per graph model at run time: ``--model actor=DIR,reward=DIR2`` (config field ``model``)
gives each model's ``ModelRun.checkpoint``; unnamed models follow their ``init_from`` model, the
default entry or the actor; unknown keys are refused naming the graph's models and roles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl import api
from flowrl.cli import main
from flowrl.contract.model import base_folder, for_config
from flowrl.errors import ConfigError
from flowrl.planner.passes import model_checkpoints
from flowrl.runtime.runstate import manifest
from flowrl.specs import TinyModelConfig

SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "task=copy"]


def folder(path: Path, hidden: int = 32) -> Path:
    """An HF model folder as far as the planner reads it: its config.json (and a weights file)."""
    path.mkdir(parents=True)
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "intermediate_size": 2 * hidden,
        "vocab_size": 64,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"x" * hidden)
    return path


@pytest.fixture()
def dirs(tmp_path):
    return {name: folder(tmp_path / name, hidden) for name, hidden in (("a", 32), ("rm", 64), ("c", 48))}


def checkpoints(graph: str, model: str) -> dict[str, str | None]:
    g, _ = api.load(graph, overrides=SMALL)
    return model_checkpoints(g, model)


def test_each_model_gets_its_own_folder_in_its_model_run(dirs):
    model = f"actor={dirs['a']},reward={dirs['rm']}"
    _, plan = api.plan("graphs/ppo_rm.py", overrides=SMALL, flags={"model": model}, emit=lambda s: None)
    got = {name: run.checkpoint for name, run in plan.models.items()}
    a, rm = str(dirs["a"].resolve()), str(dirs["rm"].resolve())
    # the reference and the critic start where their actor does (init_from); the reward model is its own
    assert got == {"actor": a, "critic": a, "ref": a, "rm": rm}
    assert plan.target.model.hidden == 32  # the run's base shape is the actor's
    assert set(manifest(plan)["base"]) == {a, rm}  # every folder's weight files, for resume


def test_names_roles_defaults_and_the_actor_fill_in_unnamed_models(dirs):
    a, rm, c = (str(dirs[k].resolve()) for k in ("a", "rm", "c"))
    # a graph model's own name; a role; what nothing names follows its init_from model
    assert checkpoints("graphs/ppo_rm.py", f"{dirs['a']},rm={dirs['rm']},critic={dirs['c']}") == {
        "actor": a,
        "critic": c,
        "ref": a,
        "rm": rm,
    }
    # only the reward model named: no folder reaches the others, which are the fresh tiny model
    assert checkpoints("graphs/ppo_rm.py", f"reward={dirs['rm']}") == {
        "actor": None,
        "critic": None,
        "ref": None,
        "rm": rm,
    }
    # one folder for all, as before (absolute)
    assert set(checkpoints("graphs/ppo_rm.py", str(dirs["a"])).values()) == {a}
    assert set(checkpoints("graphs/ppo_rm.py", None).values()) == {None}


def test_a_model_without_init_from_takes_the_default_else_the_actors_folder(dirs):
    from flowrl.graph import Graph

    g = Graph("judged")
    g.model("actor", "actor")
    g.model("judge", "reward")
    g.model("coster", "cost")
    a, rm, c = (str(dirs[k].resolve()) for k in ("a", "rm", "c"))
    assert model_checkpoints(g, f"actor={dirs['a']},judge={dirs['rm']}") == {"actor": a, "judge": rm, "coster": a}
    assert model_checkpoints(g, f"{dirs['c']},actor={dirs['a']}") == {"actor": a, "judge": c, "coster": c}


def test_an_unknown_key_is_refused_naming_the_graphs_models_and_roles(dirs):
    with pytest.raises(ConfigError) as err:
        checkpoints("graphs/ppo_rm.py", f"actor={dirs['a']},judge={dirs['rm']}")
    text = str(err.value)
    assert "'judge'" in text and "actor, critic, ref, rm" in text and "reference" in text and "reward" in text
    with pytest.raises(ConfigError, match="'reward', which is neither"):  # ppo scores with a rule: no reward model
        checkpoints("ppo", f"actor={dirs['a']},reward={dirs['rm']}")


def test_the_base_shape_is_the_actors_or_the_defaults_and_every_folder_is_checked(dirs, tmp_path):
    a, rm = dirs["a"], dirs["rm"]
    assert base_folder(f"actor={a},reward={rm}") == str(a)
    assert base_folder(f"{rm},actor={a}") == str(a)
    assert base_folder(f"{rm},critic={a}") == str(rm)
    assert base_folder(f"reward={rm}") is None
    assert for_config(f"reward={rm}", TinyModelConfig(), 50).name == "tiny-llama"
    assert for_config(f"actor={a},reward={rm}", TinyModelConfig(), 50).hidden == 32
    with pytest.raises(ConfigError, match="entry 'reward'.*does not exist"):
        for_config(f"actor={a},reward={tmp_path / 'nope'}", TinyModelConfig(), 50)


def test_run_flags_take_name_equals_folder_and_keep_the_planner_meaning_otherwise(dirs, tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    argv = ["plan", "graphs/ppo_rm.py", *(x for s in SMALL for x in ("--set", s)), "--out", str(out)]
    assert main([*argv, "--model", f"actor={dirs['a']},reward={dirs['rm']}"]) == 0, capsys.readouterr().err
    from flowrl.contract.plan import load_plan

    plan = load_plan(out)
    assert plan.config.model == f"actor={dirs['a'].resolve()},reward={dirs['rm'].resolve()}"
    assert plan.models["rm"].checkpoint == str(dirs["rm"].resolve())
    assert main([*argv, "--force", "--model", f"actor={dirs['a']},reward={tmp_path / 'nope'}"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "does not exist" in err and "nope" in err
    assert main([*argv, "--force", "--model", "actor=llama-7b,reward=llama-7b"]) == 2
    assert "--cluster" in capsys.readouterr().err


def test_a_run_whose_only_role_folder_is_missing_says_the_folder_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "runs" / "reward_model" / "checkpoint"
    assert main(["run", "graphs/ppo_rm.py", "--model", f"reward={missing}", "--steps", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"the folder of 'reward' ({missing}) does not exist" in err
    assert "planner model" not in err  # a path is not a preset: --cluster would not help
