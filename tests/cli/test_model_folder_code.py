"""A model folder's own Python (an ``auto_map`` in config.json or tokenizer_config.json) runs only with
``flowrl run --trust-remote-code``: without it the run is refused before anything loads, naming the
folder, the file and the flag, and never asks on stdin (transformers' "run the custom code? [y/N]");
a plan file or run folder that says ``trust_remote_code: true`` does not grant it; with the flag the
folder's code is imported and the run trains its model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL_RUN, run_cli

from flowrl.errors import ConfigError
from flowrl.specs import TinyModelConfig, remote_code

ROOT = Path(__file__).resolve().parents[2]
SETS = [a for s in SMALL_RUN for a in ("--set", s)]

#: The folder's own module: a Llama under another model_type, so only its auto_map can load it.
CUSTOM = """
from transformers import LlamaConfig, LlamaForCausalLM

print("flowrl-test: the folder's custom code ran", flush=True)


class CustomConfig(LlamaConfig):
    model_type = "flowrl-test-custom"


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""
AUTO_MAP = {"AutoConfig": "custom_model.CustomConfig", "AutoModelForCausalLM": "custom_model.CustomForCausalLM"}


def _folder(chat_model: str, tmp_path: Path, file: str = "config.json") -> Path:
    """A copy of the tiny chat model whose ``file`` has an auto_map (config.json: the custom class)."""
    folder = tmp_path / "model"
    shutil.copytree(chat_model, folder)
    (folder / "custom_model.py").write_text(CUSTOM)
    data = json.loads((folder / file).read_text())
    data["auto_map"] = AUTO_MAP if file == "config.json" else {"AutoTokenizer": ["custom_model.Tok", None]}
    if file == "config.json":
        data["model_type"] = "flowrl-test-custom"
        data["architectures"] = ["CustomForCausalLM"]
    (folder / file).write_text(json.dumps(data))
    return folder


def _cli(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m flowrl ARGV` with stdin closed (a question would read EOF) and a bound so a hang fails."""
    return subprocess.run(
        [sys.executable, "-m", "flowrl", *argv],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf-modules"), **(env or {})},
    )


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_a_folder_with_its_own_code_is_refused_without_the_flag_naming_folder_file_and_flag(
    file, chat_model, tmp_path, capsys
):
    folder = _folder(chat_model, tmp_path, file)
    code, _, err = run_cli(capsys, "run", "grpo", "--model", str(folder), "--steps", "1", "--out", str(tmp_path), *SETS)
    assert code == 2, err
    assert str(folder.resolve()) in err and file in err and "--trust-remote-code" in err, err
    assert "Traceback" not in err and "[y/N]" not in err
    assert not (tmp_path / "grpo" / "metrics.jsonl").exists()


def test_a_per_model_folder_with_code_is_refused_naming_its_entry(chat_model, tmp_path, capsys):
    folder = _folder(chat_model, tmp_path)
    code, _, err = run_cli(
        capsys, "run", "grpo", "--model", f"actor={folder}", "--steps", "1", "--out", str(tmp_path), *SETS
    )
    assert code == 2 and "--model actor=folder" in err and "config.json" in err and "--trust-remote-code" in err, err


@pytest.mark.slow
def test_the_refusal_never_asks_on_stdin_in_a_real_process(chat_model, tmp_path):
    folder = _folder(chat_model, tmp_path)
    done = _cli(tmp_path, "run", "grpo", "--model", str(folder), "--steps", "1", "--out", str(tmp_path), *SETS)
    assert done.returncode == 2, done.stderr
    assert "--trust-remote-code" in done.stderr and "[y/N]" not in done.stdout + done.stderr
    assert "custom code ran" not in done.stdout and "Traceback" not in done.stderr


@pytest.mark.slow
def test_with_the_flag_the_folders_code_runs_and_the_model_trains(chat_model, tmp_path):
    folder = _folder(chat_model, tmp_path)
    done = _cli(
        tmp_path, "run", "grpo", "--model", str(folder), "--trust-remote-code", "--steps", "1", "--quiet",
        "--out", str(tmp_path / "runs"), *SETS,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the folder's custom code ran" in done.stdout
    assert len((tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()) == 1


def test_the_local_loaders_refuse_a_folder_with_code_unless_trusted(chat_model, tmp_path):
    from flowrl.backends.local.models import build_model, load_tokenizer, model_config

    folder = str(_folder(chat_model, tmp_path))
    tok = load_tokenizer(chat_model)
    for call in (
        lambda: load_tokenizer(folder),
        lambda: model_config(folder, TinyModelConfig(), tok),
        lambda: build_model(folder, None, 0, scalar_head=False),
        lambda: build_model(folder, None, 0, scalar_head=True),
    ):
        with pytest.raises(ConfigError, match=r"config\.json has an 'auto_map'.*--trust-remote-code"):
            call()


def test_a_plain_folder_has_no_code_and_a_damaged_config_is_left_to_its_loader(chat_model, tmp_path):
    assert remote_code(chat_model) == []
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text('["auto_map"]')
    assert remote_code(broken) == []


def test_a_plan_file_that_trusts_does_not_grant_it(chat_model, tmp_path, capsys):
    folder = _folder(chat_model, tmp_path)
    plan = tmp_path / "plan.yaml"
    trusting = ["--set", "trust_remote_code=true", "--out", str(plan), "--steps", "1"]
    code, _, err = run_cli(capsys, "plan", "grpo", "--model", str(folder), *trusting, *SETS)
    assert code == 0, err
    assert "trust_remote_code: true" in plan.read_text()
    code, _, err = run_cli(capsys, "run", "--plan", str(plan), "--out", str(tmp_path))
    assert code == 2 and "--trust-remote-code" in err and "config.json" in err, err


def test_resume_of_a_run_folder_does_not_grant_it_either(chat_model, tmp_path, capsys):
    """A run folder whose plan.yaml says trust_remote_code: true (edited, or from a trusted run) is refused
    on --resume without the flag: the permission is the command line's."""
    folder = _folder(chat_model, tmp_path)
    run = tmp_path / "grpo"
    trusting = ["--set", "trust_remote_code=true", "--out", str(tmp_path / "p.yaml")]
    code, _, err = run_cli(capsys, "plan", "grpo", "--model", str(folder), *trusting, *SETS)
    assert code == 0, err
    run.mkdir()
    shutil.copy(tmp_path / "p.yaml", run / "plan.yaml")
    code, _, err = run_cli(capsys, "run", "--resume", str(run))
    assert code == 2 and "--trust-remote-code" in err, err
