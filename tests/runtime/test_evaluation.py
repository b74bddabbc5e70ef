"""Evaluation (flowrl.runtime.evaluate): its prompt set, majority votes as the verifier counts answers
equal, greedy-only evaluation, and generation batches no larger than a training step's."""

from __future__ import annotations

import pytest
from helpers import write_jsonl

from flowrl import api
from flowrl.contract.data import Prompt
from flowrl.runtime.evaluate import Scored, eval_prompts, summarize
from flowrl.runtime.executor import run_dir
from flowrl.specs import build_config
from flowrl.tasks.dataset import load


def test_without_data_val_evaluation_takes_each_training_row_at_most_once(tmp_path):
    # a dataset task without data.val evaluates on its training rows, each once (drawn with replacement,
    # 64 prompts of 5 rows would weight every metric by chance)
    rows = [{"prompt": f"{c}>", "answer": c} for c in "abcde"]
    cfg = build_config({"data": {"train": write_jsonl(tmp_path / "t.jsonl", rows), "verifier": "exact"}})
    task = load(cfg)
    prompts = eval_prompts(cfg, task)
    assert sorted(p.text for p in prompts) == sorted(r["prompt"] for r in rows)
    few = build_config({"data": {"train": cfg.data.train, "verifier": "exact"}, "eval": {"prompts": 3}})
    chosen = [p.text for p in eval_prompts(few, load(few))]
    assert len(chosen) == 3 == len(set(chosen))
    assert chosen == [p.text for p in eval_prompts(few, load(few))]  # a fixed, seeded set


def test_majority_vote_counts_answers_the_exact_verifier_calls_equal():
    class Exact:
        verifier = "exact"

        def score(self, prompt, response):
            from flowrl.tasks.verifiers import verify

            return verify("exact", response, prompt.answer)

    task, p = Exact(), Prompt(text="q", answer="1000")
    # three samples say 1000 (the verifier reads "1,000." and "1000" alike), two say 8
    texts = ["8", "8", "1,000.", "1000", "1000"]
    row = Scored(p, None, [(t, task.score(p, t)) for t in texts])
    assert summarize(task, [row], 5, "source")["eval/maj@5"] == 1.0


@pytest.mark.slow
def test_greedy_only_evaluation_with_eval_samples_0(tmp_path):
    # K = 0: greedy accuracy alone, without K times the generation (refused only without greedy)
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="eval.greedy is false"):
        build_config({"eval": {"samples": 0, "greedy": False}})
    overrides = ["progress=false", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "checkpoint=false"]
    overrides += ["eval.every=1", "eval.samples=0", "eval.prompts=3"]
    g, plan = api.plan("grpo", overrides=overrides, flags={"steps": 1}, emit=lambda s: None)
    result = api.run(g, plan, out_dir=run_dir(str(tmp_path), "greedy"))
    assert [e["step"] for e in result.evals] == [0, 1]
    assert {k for k in result.evals[0] if k.startswith("eval/")} == {"eval/greedy", "eval/prompts"}


def test_majority_vote_counts_the_same_math_answer_in_dollars_as_one():
    class Math:
        verifier = "math"

    p = Prompt(text="q", answer="18")
    # "18" three times (once as "$18."), "20" twice: the majority is right
    texts = ["20", "20", "The answer is $18.", "18", "it is 18"]
    row = Scored(p, None, [(t, 1.0 if "18" in t else 0.0) for t in texts])
    assert summarize(Math(), [row], 5, "source")["eval/maj@5"] == 1.0


def test_evaluation_generates_at_most_a_training_steps_rows_at_once():
    # eval.samples=16 with 4 x 2 rows a step: never 4 prompts x 16 = 64 rows at once (8x what the plan
    # sized generation for); greedy takes 8 prompts at a time, as 8 rows fit
    import torch

    from flowrl.runtime.evaluate import Evaluator

    class Seqs:
        def __init__(self, prompts, n):
            self.texts = ["x"] * (len(prompts) * n)
            self.prompt_index = torch.arange(len(prompts)).repeat_interleave(n)

    class Generator:
        version, calls = 0, []

        def generate(self, prompts, *, n, greedy, generator, max_new_tokens, temperature):
            self.calls.append((len(prompts) * n, greedy))
            return type("Rollout", (), {"sequences": Seqs(prompts, n)})()

    class Task:
        verifier = "exact"

        def prompts(self, rng, n):
            return [Prompt(text=f"{i}", answer="x") for i in range(n)]

        def score(self, prompt, response):
            return 1.0

    cfg = build_config(
        {"rollout": {"prompts_per_step": 4, "samples_per_prompt": 2}, "eval": {"every": 1, "samples": 16, "prompts": 8}}
    )
    gen = Generator()
    record, rows = Evaluator(cfg, Task(), gen, 4).run(0)
    assert record["eval/mean@16"] == 1.0 and all(len(r.samples) == 16 for r in rows)
    assert max(size for size, _ in gen.calls) <= 8
    assert [size for size, greedy in gen.calls if greedy] == [8]  # the 8 greedy prompts in one call
