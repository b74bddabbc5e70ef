"""Hostile --config files and --set values: a billion-laughs YAML, a huge or special file, a name too
long, numbers too long and values nested too deeply are exit 2 with one paragraph, in bounded time."""

from __future__ import annotations

import os

import pytest
from helpers import run_cli

from flowrl import specs
from flowrl.errors import ConfigError


def refuses(capsys, *args: str) -> str:
    code, _, err = run_cli(capsys, "plan", "grpo", *args)
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("flowrl: error:")
    return err


def laughs(levels: int) -> str:
    lines = ['l0: &l0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_billion_laughs_config_is_refused_before_it_is_walked(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(laughs(12))  # 9**12 values once expanded
    err = refuses(capsys, "--config", str(path))
    assert "run.yaml' expands to over" in err and "anchors" in err


def test_a_config_with_a_few_anchors_is_read(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("base: &lr 0.001\ntrain:\n  lr: *lr\n")
    assert specs.read_document(path)["train"]["lr"] == 0.001


def test_a_config_over_the_size_cap_is_refused_unparsed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(specs, "MAX_CONFIG_BYTES", 1024)
    path = tmp_path / "run.yaml"
    path.write_text("steps: 1\n" + "#" * 2000 + "\n")
    err = refuses(capsys, "--config", str(path))
    assert "run.yaml' is over the" in err and "MAX_CONFIG_BYTES" in err


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_config_that_is_no_regular_file_is_refused_without_blocking(tmp_path, capsys, kind):
    path = tmp_path / "run.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    assert "is not a regular file" in refuses(capsys, "--config", str(path))


def test_a_config_name_too_long_for_the_file_system_is_refused_naming_it(capsys):
    assert "cannot be read: File name too long" in refuses(capsys, "--config", "c" * 5000 + ".yaml")


def test_a_missing_config_is_still_said_to_be_missing(tmp_path, capsys):
    assert "does not exist" in refuses(capsys, "--config", str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("steps: !!python/object/apply:os.system ['true']\n", "could not determine a constructor"),
        ("a: " + "[" * 50000 + "]" * 50000 + "\n", "maximum recursion depth"),
        ("steps: 1\nsteps: 2\n", "key 'steps' is given twice"),
        ("steps: " + "9" * 6000 + "\n", "is not valid YAML"),
        ("base: &b {lr: 1}\ntrain:\n  <<: *b\n", "is not valid YAML"),
        ("? [a, b]\n: 1\n", "unhashable key"),
    ],
)
@pytest.mark.slow
def test_a_hostile_yaml_config_is_refused_naming_it(tmp_path, capsys, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    err = refuses(capsys, "--config", str(path))
    assert "run.yaml" in err and expected in err


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("steps=" + "9" * 5000, "--set 'steps': the value is a number too long to read"),
        ("train.lr=" + "[" * 100000 + "]" * 100000, "--set 'train.lr': the value is nested too deeply"),
        ("train.lr=[1, 2]", "field 'train.lr'"),
        ("train.lr=nan", "field 'train.lr'"),
        ("train.lr.x.y=1", "field 'train.lr'"),
        ("rollout.prompts_per_step=99999999999999999999999", "'rollout.prompts_per_step' must be in"),
        ("rollout.max_new_tokens=1000000000000", "'rollout.max_new_tokens' must be in"),
    ],
)
@pytest.mark.slow
def test_a_hostile_set_value_is_refused_naming_the_key(capsys, value, expected):
    assert expected in refuses(capsys, "--set", value)


def test_a_set_value_of_nested_aliases_is_refused_before_it_is_walked():
    anchors = ["&a0 [1,1,1,1,1,1,1,1,1]"] + [f"&a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    with pytest.raises(ConfigError, match="expands to over"):
        specs.parse_override("train.lr=[" + ",".join(anchors) + "]")


@pytest.mark.parametrize(
    "args",
    [
        ("run", "grpo", "--model", "m" * 5000, "--steps", "1"),
        ("run", "grpo", "--out", "o" * 5000, "--steps", "1"),
        ("run", "grpo", "--resume", "r" * 5000, "--steps", "1"),
        ("calibrate", "r" * 5000),
    ],
)
def test_a_path_too_long_for_the_file_system_is_exit_2_in_any_command(capsys, args):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "flowrl: error: the path" in err and "File name too long" in err and "Traceback" not in err
    assert "characters)" in err and len(err) < 500  # the path is shortened, not printed whole


def test_a_trace_nested_too_deeply_is_refused_naming_the_run(tmp_path, monkeypatch):
    from flowrl.planner import traces
    from flowrl.planner.traces import read_run

    (tmp_path / "plan.yaml").write_text("{}")
    (tmp_path / "trace.json").write_text("[" * 100000)
    monkeypatch.setattr(traces, "load_plan", lambda path: None)  # the plan is read first; the trace is what is tested

    with pytest.raises(ConfigError, match="trace.json is nested too deeply"):
        read_run(tmp_path)
