"""Runs on the user's data: the README's command, evaluation records and samples, a resume in the
middle of an epoch that equals the uninterrupted run, and a task a graph file registers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import write_jsonl

from flowrl import api, cli
from flowrl.contract.data import Prompt
from flowrl.contract.plan import load_plan
from flowrl.runtime.evaluate import Scored, pass_at_k, summarize
from flowrl.runtime.executor import run_dir

TIMING = ("step_seconds", "tokens_per_s", "spans")


def copy_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        s = "".join(rng.choice("abcd") for _ in range(rng.randint(1, 3)))
        rows.append({"prompt": f"{s}>", "answer": s, "source": "one" if len(s) == 1 else "more", "id": i})
    return rows


def _records(folder: Path) -> list[dict]:
    out = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.append({k: v for k, v in record.items() if k not in TIMING and not k.endswith("/seconds")})
    return out


class Crash(Exception):
    pass


def test_pass_at_k_is_the_unbiased_estimate_and_majority_reads_final_answers():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)

    class Math:
        verifier = "math"

    p = Prompt(text="q", answer="7", meta={"source": "s"})
    rows = [
        # 3 of 4 samples say 7 in different words: the majority is right, mean@4 0.75
        Scored(p, ("the answer is 7", 1.0), [("7", 1.0), ("so \\boxed{7}", 1.0), ("#### 7", 1.0), ("8", 0.0)]),
        # the majority (2 x 9) is wrong although one sample is right
        Scored(p, ("9", 0.0), [("9", 0.0), ("it is 9", 0.0), ("7", 1.0), ("5", 0.0)]),
    ]
    out = summarize(Math(), rows, 4, "source")
    assert out["eval/greedy"] == 0.5
    assert out["eval/mean@4"] == pytest.approx(4 / 8)
    assert out["eval/pass@4"] == 1.0 and out["eval/pass@1"] == pytest.approx((0.75 + 0.25) / 2)
    assert out["eval/maj@4"] == 0.5
    assert "eval/s/greedy" not in out  # one source: no breakdown


@pytest.mark.slow
def test_a_resume_mid_epoch_equals_the_uninterrupted_run_with_evaluations_and_samples(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", copy_rows(9))
    val = write_jsonl(tmp_path / "val.jsonl", copy_rows(6, seed=1))
    overrides = [
        "progress=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "save_every=2",
        f"data.val={val}", "data.verifier=exact", "eval.every=3", "eval.samples=2", "log.samples_every=2",
        "log.samples=2",
    ]  # fmt: skip
    graph, plan = api.plan(
        "grpo", overrides=overrides, flags={"steps": 6, "data": {"train": [train]}}, emit=lambda s: None
    )
    assert plan.config.task == "data"
    whole = run_dir(str(tmp_path), "whole")
    result = api.run(graph, plan, out_dir=whole)
    assert [e["step"] for e in result.evals] == [0, 3, 6]
    part = run_dir(str(tmp_path), "part")

    def crash(record: dict) -> None:
        if record.get("kind") is None and record["step"] == 4:
            raise Crash

    with pytest.raises(Crash):
        api.run(graph, plan, out_dir=part, on_step=crash)
    state = json.loads((part / "checkpoints" / "step-000003" / "state.json").read_text())
    # the stream's cursor: steps 0-3 and step 4 (drawn ahead, in the snapshot) took 20 prompts
    assert state["data"] == {"epoch": 2, "index": 2, "rows": 9}
    resumed = api.run(graph, load_plan(part / "plan.yaml"), out_dir=part, resume=True)
    assert resumed.resumed_from == 4
    assert _records(whole) == _records(part)  # steps and evaluations, no gap, no repeat
    assert (whole / "samples.jsonl").read_text() == (part / "samples.jsonl").read_text()
    samples = [json.loads(line) for line in (whole / "samples.jsonl").read_text().splitlines()]
    assert {s["kind"] for s in samples} == {"eval", "train"}
    assert all({"prompt", "answer", "response", "reward", "step"} <= s.keys() for s in samples)
    evals = [r for r in _records(whole) if r.get("kind") == "eval"]
    assert {"eval/greedy", "eval/mean@2", "eval/pass@2", "eval/maj@2", "eval/one/greedy", "eval/more/mean@2"} <= evals[
        0
    ].keys()
    assert result.metrics[-1]["prompts_drawn"] == 24  # 2 epochs of 9 rows and 6 of the third


@pytest.mark.slow
def test_the_readme_command_runs_as_written(tmp_path, chat_model, monkeypatch, capsys):
    problems = [
        {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}. #### {a + b}"}
        for a in range(6)
        for b in range(3)
    ]
    write_jsonl(tmp_path / "train.jsonl", problems[:12])
    write_jsonl(tmp_path / "val.jsonl", problems[12:])
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        [
            "run", "grpo", "--model", chat_model, "--data", "train.jsonl", "--set", "data.val=val.jsonl",
            "--set", "data.prompt_key=question", "--set", "data.answer_key=answer", "--set", "data.verifier=math",
            "--set", "eval.every=10",
            # small enough for a test
            "--steps", "2", "--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2",
            "--set", "rollout.max_new_tokens=8", "--set", "eval.samples=2", "--set", "progress=false",
        ]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in Path("runs/grpo/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [0, 2] and evals[0]["eval/prompts"] == 6
    out = capsys.readouterr().out
    assert "data train: 12 prompts of 12 rows (chat template applied)" in out


def test_a_graph_file_registers_its_own_task(tmp_path, capsys):
    graph = tmp_path / "mine.py"
    graph.write_text(
        """
import msgspec
from flowrl import register
from flowrl.contract import Prompt
from flowrl.graphs.grpo import build


@register.task("ab")
class AB(msgspec.Struct, frozen=True):
    letter: str = "a"

    def max_new_tokens(self):
        return 3

    def prompts(self, rng, n):
        return [Prompt(text=f"{self.letter}>", answer=self.letter) for _ in range(n)]

    def score(self, prompt, response):
        return float(response == prompt.answer)
"""
    )
    code = cli.main(
        ["run", str(graph), "--task", "ab", "--steps", "1", "--out", str(tmp_path / "runs"),
         "--set", "progress=false", "--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2",
         "--set", "task_options.letter=b"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    plan = load_plan(tmp_path / "runs" / "grpo" / "plan.yaml")  # the graph it builds is grpo
    assert plan.config.task == "ab"


def test_bad_data_is_one_paragraph_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a>", "answer": "a"}\n{oops}\n')
    assert cli.main(["run", "grpo", "--data", str(bad), "--steps", "1", "--out", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # wrapped to the terminal's width
    assert "line 2 is not valid JSON" in err and "Traceback" not in err
    assert cli.main(["run", "grpo", "--task", "add", "--data", str(bad), "--out", str(tmp_path)]) == 2
    assert "drop --task" in " ".join(capsys.readouterr().err.split())


@pytest.mark.slow
def test_a_tensorboard_logger_gets_every_step_and_evaluation_once_across_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    small = ["--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2", "--quiet"]
    first = ["run", "grpo", "--steps", "2", "--save-every", "1", "--logger", "tensorboard", "--set", "eval.every=1",
             "--set", "eval.prompts=4", "--set", "eval.samples=2", "--out", str(tmp_path), *small]  # fmt: skip
    assert cli.main(first) == 0
    assert cli.main(["run", "--resume", str(tmp_path / "grpo"), "--steps", "3", "--quiet"]) == 0
    events = EventAccumulator(str(tmp_path / "grpo" / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") is None]
    assert [e.step for e in events.Scalars("reward")] == [0, 1, 2]
    assert [e.value for e in events.Scalars("reward")] == pytest.approx([r["reward"] for r in steps])
    assert [e.step for e in events.Scalars("eval/mean@2")] == [0, 1, 2, 3]


def test_rollout_stop_strings_end_every_response_and_reach_the_plan(tmp_path):
    overrides = ["progress=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=2", "checkpoint=false",
                 "rollout.stop=[b, '|']", "log.samples_every=1", "log.samples=8"]  # fmt: skip
    graph, plan = api.plan("grpo", overrides=overrides, flags={"steps": 2}, emit=lambda s: None)
    assert plan.models["actor"].sampling.stop == ("b", "|")
    api.run(graph, plan, out_dir=run_dir(str(tmp_path), "stop"))
    rows = [json.loads(line) for line in (tmp_path / "stop" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 16
    ended = [r["response"] for r in rows if "b" in r["response"] or "|" in r["response"]]
    assert ended and all(min(r.find(c) for c in "b|" if c in r) == len(r) - 1 for r in ended)  # cut after it


@pytest.mark.slow
def test_a_resume_after_the_training_data_changed_is_refused(tmp_path, monkeypatch, capsys):
    rows = [{"prompt": f"{c}>", "answer": c} for c in "abcdab"]
    write_jsonl(tmp_path / "r.jsonl", rows)
    monkeypatch.chdir(tmp_path)
    small = ["--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=2", "--quiet"]
    first = ["run", "grpo", "--data", "r.jsonl", "--set", "data.verifier=exact", "--steps", "2", "--save-every", "1"]
    assert cli.main([*first, "--out", "runs", *small]) == 0
    write_jsonl(tmp_path / "r.jsonl", rows + rows)  # the file grew since the checkpoint
    capsys.readouterr()
    assert cli.main(["run", "--resume", "runs/grpo", "--steps", "3", "--quiet"]) == 2
    assert "data" in capsys.readouterr().err


def test_a_plan_keeps_the_data_files_absolute_like_the_model_folder(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a>", "answer": "a"}])
    write_jsonl(tmp_path / "val.jsonl", [{"prompt": "b>", "answer": "b"}])
    monkeypatch.chdir(tmp_path)
    args = ["plan", "grpo", "--data", "train.jsonl", "--set", "data.val=val.jsonl", "--out", "plan.yaml"]
    assert cli.main(args) == 0
    data = load_plan(tmp_path / "plan.yaml").config.data
    assert [Path(f).is_absolute() for f in data.files("train") + data.files("val")] == [True, True]
