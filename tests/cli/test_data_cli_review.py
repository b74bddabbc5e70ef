"""Review of issue 22 (train on your data) from the command line: where a plan keeps the data files."""

from __future__ import annotations

import json
from pathlib import Path

from flowrl import cli
from flowrl.planner.plan import load_plan


def test_a_plan_keeps_the_data_files_absolute_like_the_model_folder(tmp_path, monkeypatch):
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "a>", "answer": "a"}) + "\n")
    (tmp_path / "val.jsonl").write_text(json.dumps({"prompt": "b>", "answer": "b"}) + "\n")
    monkeypatch.chdir(tmp_path)
    args = ["plan", "grpo", "--data", "train.jsonl", "--set", "data.val=val.jsonl", "--out", "plan.yaml"]
    assert cli.main(args) == 0
    data = load_plan(tmp_path / "plan.yaml").config.data
    assert [Path(f).is_absolute() for f in data.files("train") + data.files("val")] == [True, True]
