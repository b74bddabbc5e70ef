"""LoRA adapts a trained model: a run that trains adapters over a freshly initialised tiny model (no
checkpoint) is told, once per such model, that it will learn little and what to do instead; a run
that adapts a checkpoint, trains whole, or only freezes the model is not."""

from __future__ import annotations

from helpers import SMALL_RUN, run_cli

from flowrl import api
from flowrl.contract import lora_on_fresh_weights


def _plan(*overrides: str):
    return api.plan("graphs/grpo.py", overrides=list(overrides), emit=lambda s: None)[1]


def test_lora_over_a_fresh_tiny_model_is_warned_about_naming_the_model_and_the_way_out():
    (warning,) = lora_on_fresh_weights(_plan("train.lora.rank=8"))
    assert "model 'actor' trains LoRA adapters (train.lora.rank=8) over a fresh tiny model" in warning
    assert "train.lora.rank=0" in warning and "--model" in warning


def test_full_training_and_lora_over_a_checkpoint_are_not_warned_about(tmp_path):
    assert lora_on_fresh_weights(_plan()) == []
    base = api.run(
        *api.plan("graphs/grpo.py", overrides=[*SMALL_RUN, "steps=1", f"out={tmp_path}"], emit=lambda s: None)
    )
    folder = base.checkpoints["actor"]
    assert lora_on_fresh_weights(_plan("train.lora.rank=8", f"model={folder}")) == []


def test_flowrl_run_prints_the_warning_once_on_stderr(tmp_path, capsys):
    sets = [a for s in SMALL_RUN for a in ("--set", s)]
    code, out, err = run_cli(
        capsys, "run", "graphs/grpo.py", "--steps", "1", "--out", str(tmp_path), "--set", "train.lora.rank=4", *sets
    )
    assert code == 0, err
    assert err.count("flowrl: warning: model 'actor' trains LoRA adapters (train.lora.rank=4)") == 1, err
