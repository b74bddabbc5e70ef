"""Per-role models: `flowrl plan --model actor=llama-34b,reward=llama-7b` (or a per-role model file)
plans each graph model with its own shape: memory, cost and layouts per role."""

from __future__ import annotations

import pytest

from flowrl.cli import main
from flowrl.contract.plan import load_plan
from flowrl.errors import ConfigError
from flowrl.planner.modelspec import MODEL_PRESETS, load_model_specs, role_models

PLAN = ["plan", "graphs/ppo_rm.py", "--cluster", "16xH100-80G", "--budget", "2"]
ROLES = {"actor": "actor", "critic": "critic", "ref": "reference", "rm": "reward"}


def test_per_role_entries_parse_with_an_optional_default():
    default, roles = load_model_specs("actor=llama-34b, reward=llama-7b")
    assert default is None and roles == {"actor": MODEL_PRESETS["llama-34b"], "reward": MODEL_PRESETS["llama-7b"]}
    default, roles = load_model_specs("llama-13b,reward=llama-7b")
    assert default == MODEL_PRESETS["llama-13b"] and set(roles) == {"reward"}
    assert load_model_specs("llama-7b") == (MODEL_PRESETS["llama-7b"], {})


def test_unnamed_roles_follow_the_actor_or_the_reward_model():
    big, small = MODEL_PRESETS["llama-34b"], MODEL_PRESETS["llama-7b"]
    shapes = role_models({"actor": big, "reward": small}, ROLES)
    assert shapes == {"actor": big, "ref": big, "rm": small, "critic": small}
    # a graph model's own name wins over its role; a default covers what nothing names
    mid = MODEL_PRESETS["llama-13b"]
    shapes = role_models({"*": mid, "critic": big}, ROLES)
    assert shapes == {"actor": mid, "ref": mid, "rm": mid, "critic": big}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("actor=llama-34b,actor=llama-7b", "names role 'actor' twice"),
        ("actor=", "must be ROLE=MODEL"),
        ("actor=llama-34b,reward=llama-8", "entry 'reward=llama-8'"),
        ("llama-7b,actor=llama-34b,llama-13b", "two default models"),
    ],
)
def test_bad_per_role_entries_name_the_entry(text, message):
    with pytest.raises(ConfigError, match=message):
        load_model_specs(text)


@pytest.mark.slow
def test_the_plan_gives_each_role_its_own_shape_memory_and_time(tmp_path, capsys):
    same = tmp_path / "same.yaml"
    mixed = tmp_path / "mixed.yaml"
    assert main([*PLAN, "--model", "llama-34b", "--out", str(same), "--require", "placement=colocate"]) == 0
    code = main(
        [*PLAN, "--model", "actor=llama-34b,reward=llama-7b", "--out", str(mixed), "--require", "placement=colocate"]
    )
    assert code == 0
    a, b = load_plan(same), load_plan(mixed)
    assert {m: s.name for m, s in b.target.models.items()} == {
        "actor": "llama-34b",
        "ref": "llama-34b",
        "rm": "llama-7b",
        "critic": "llama-7b",
    }
    assert b.target.model.name == "llama-34b"
    # the 7B reward model and critic are cheaper to run and to hold than 34B ones
    assert b.layout.predicted.breakdown["score"] < 0.5 * a.layout.predicted.breakdown["score"]
    assert b.layout.predicted.breakdown["train_critic"] < 0.5 * a.layout.predicted.breakdown["train_critic"]
    # held over its model-parallel devices, the 7B critic's states are a fraction of the 34B one's
    critic = next(k for k in b.memory[0].breakdown if k.startswith("model critic"))

    def held(plan):
        p = plan.layout.layout("critic").parallel
        return plan.memory[0].breakdown[critic] * p.tp * p.pp

    assert held(b) < 0.5 * held(a)


@pytest.mark.slow
def test_explain_lists_every_models_shape(capsys):
    assert main([*PLAN, "--model", "actor=llama-34b,reward=llama-7b", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "models: actor=llama-34b (33.7B)" in out and "rm=llama-7b (6.7B)" in out and "critic=llama-7b" in out


@pytest.mark.slow
def test_a_per_role_model_file(tmp_path):
    spec = MODEL_PRESETS["llama-7b"]
    models = tmp_path / "models.yaml"
    models.write_text(
        "actor: llama-13b\n"
        "reward:\n"
        f"  name: my-rm\n  layers: {spec.layers // 2}\n  hidden: {spec.hidden}\n  heads: {spec.heads}\n"
        f"  kv_heads: {spec.kv_heads}\n  intermediate: {spec.intermediate}\n  vocab: {spec.vocab}\n"
    )
    out = tmp_path / "plan.yaml"
    assert main([*PLAN, "--model", str(models), "--out", str(out)]) == 0
    shapes = {m: s.name for m, s in load_plan(out).target.models.items()}
    assert shapes == {"actor": "llama-13b", "ref": "llama-13b", "rm": "my-rm", "critic": "my-rm"}


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("actor=llama-34b,judge=llama-7b", "'judge', which is neither a model of this graph"),
        ("reward=llama-7b", "gives no model for 'actor' (role actor)"),
    ],
)
def test_per_role_errors_exit_2_with_one_paragraph(model, message, capsys):
    assert main([*PLAN, "--model", model]) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and "Traceback" not in err
