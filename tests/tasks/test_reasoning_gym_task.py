"""The `reasoning_gym` task: reasoning-gym's procedural datasets drawn with the run's rng, scored by each
dataset's own score_answer, rendered for the tiny model or a chat model, with one clear error per bad option."""

from __future__ import annotations

import pickle
import random
import sys
from statistics import mean

import pytest
from helpers import ONE_LAYER, SMALL_RUN, needs

from flowrl import api
from flowrl.contract.data import Prompt
from flowrl.errors import TaskError
from flowrl.specs import build_config
from flowrl.tasks.builtin import task_for
from flowrl.tasks.reasoning_gym_task import ReasoningGymTask

pytestmark = needs("reasoning_gym")

SUMS = {"dataset": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
GRAPH = "graphs/reasoning_gym.py"


def run_task(**cfg) -> ReasoningGymTask:
    """The task of a run config (the tiny model unless ``model`` is given)."""
    from flowrl.plugins.manager import registry

    tasks = {e.name: e.obj for e in registry().entries("tasks")}
    return task_for(build_config({"task": "reasoning_gym", **cfg}), registry=tasks)


def test_prompts_are_deterministic_given_the_rng_state():
    task = ReasoningGymTask.from_options(SUMS)
    first, again = task.prompts(random.Random(7), 20), task.prompts(random.Random(7), 20)
    assert first == again
    assert first != task.prompts(random.Random(8), 20)
    rng = random.Random(7)
    assert task.prompts(rng, 10) + task.prompts(rng, 10) == first  # a stream: two draws of 10 are one of 20
    other_seed = ReasoningGymTask.from_options({**SUMS, "seed": 1})  # the dataset's seed: other problems
    assert [p.meta["index"] for p in other_seed.prompts(random.Random(7), 20)] == [p.meta["index"] for p in first]
    assert [p.text for p in other_seed.prompts(random.Random(7), 20)] != [p.text for p in first]
    p = first[0]
    assert p.text.startswith("State the final answer to the following arithmetic problem:") and p.text.endswith("=")
    assert p.meta["entry"]["answer"] == p.answer and p.meta["dataset"] == "chain_sum"


def test_the_dataset_scores_right_and_wrong_answers():
    task = ReasoningGymTask.from_options(SUMS)
    for p in task.prompts(random.Random(0), 10):
        assert task.score(p, p.answer) == 1.0
        assert task.score(p, f" {p.answer}\n") == 1.0  # the response is stripped
        assert task.score(p, "x") == 0.0
        assert task.score(p, "") == 0.0
        assert task.score(p, str(int(p.answer) + 1)) == 0.0
    tagged = ReasoningGymTask.from_options({**SUMS, "extract": "answer_tag"})
    p = tagged.prompts(random.Random(0), 1)[0]
    assert tagged.score(p, f"<think>so</think> <answer> {p.answer} </answer>") == 1.0
    assert tagged.score(p, f"<answer>99</answer> no, <answer>{p.answer}</answer>") == 1.0  # the last one
    assert tagged.score(p, p.answer) == 0.0  # no tags: no answer
    assert tagged.max_new_tokens() == task.max_new_tokens() + len("<answer></answer>")


def test_a_prompt_carries_its_entry_to_workers_and_checkpoints_and_one_without_it_is_regenerated():
    import torch  # noqa: F401 - checkpoint encoding imports it

    from flowrl.runtime.checkpoint import decode, encode

    task = ReasoningGymTask.from_options({"dataset": "graph_color"})  # no single oracle answer; int keys in its entry
    p = task.prompts(random.Random(3), 1)[0]
    assert p.answer == "" and isinstance(p.meta["entry"], dict)
    tensors: dict = {}
    for copy in (pickle.loads(pickle.dumps(p)), decode(encode(p.meta, tensors), tensors)):
        restored = copy if isinstance(copy, Prompt) else Prompt(text=p.text, answer=p.answer, meta=copy)
        assert task.entry(restored) == task.dataset[p.meta["index"]]
    bare = Prompt(text=p.text, answer=p.answer, meta={"dataset": "graph_color", "index": p.meta["index"]})
    assert task.entry(bare) == task.dataset[p.meta["index"]]
    with pytest.raises(TaskError, match="not one of its entries"):
        task.entry(Prompt(text="1+2=", answer="3"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "option 'dataset' names no dataset; choose one of: ab, acre"),
        (
            {"dataset": "chain_summ"},
            "'chain_summ' is not a reasoning-gym dataset; choose one of: .*Did you mean 'chain_sum'",
        ),
        ({**SUMS, "min_termz": 2}, "unknown option 'min_termz'; the dataset's config fields: min_terms, max_terms"),
        ({**SUMS, "min_terms": "two"}, "bad config field: Expected `int`, got `str` - at `min_terms`"),
        ({**SUMS, "min_terms": 3}, r"refuses its config \(AssertionError: max_terms must be >= min_terms\)"),
        ({**SUMS, "extract": "boxed"}, "bad option: Invalid enum value 'boxed' - at `extract`"),
        ({**SUMS, "size": 0}, "option 'size' must be at least 1"),
    ],
)
def test_a_bad_dataset_or_config_field_is_a_task_error_naming_it(options, message):
    with pytest.raises(TaskError, match=message):
        ReasoningGymTask.from_options(options)


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an environment without it imports
    with pytest.raises(TaskError, match=r"pip install 'flowrl\[reasoning-gym\]'"):
        ReasoningGymTask.from_options(SUMS)


def test_a_dataset_section_applies_only_while_that_dataset_is_chosen():
    options = {"dataset": "count_bits", "count_bits": {"max_n": 3}, "chain_sum": {"min_terms": 9}}
    task = ReasoningGymTask.from_options(options)
    assert {p.answer for p in task.prompts(random.Random(0), 30)} <= {"1", "2"}
    assert (
        ReasoningGymTask.from_options({**options, "dataset": "chain_sum", "max_terms": 9}).dataset.config.min_terms == 9
    )


def test_the_tiny_model_gets_plain_text_and_a_chat_model_its_template(chat_model):
    tiny = run_task(task_options=SUMS)
    p = tiny.prompts(random.Random(0), 1)[0]
    assert not p.templated and p.text == p.meta["entry"]["question"]
    assert tiny.prompt_tokens() == len(p.text) + 1  # characters and BOS (all its questions are as long)
    chat = run_task(task_options=SUMS, model=chat_model, data={"system_prompt": "Answer with the number."})
    q = chat.prompts(random.Random(0), 1)[0]
    assert q.templated and q.meta == p.meta
    assert q.text == (
        f"<|im_start|>system\nAnswer with the number.<|im_end|>\n<|im_start|>user\n{p.text}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert q.messages == ({"role": "system", "content": "Answer with the number."}, {"role": "user", "content": p.text})
    assert chat.score(q, q.answer) == 1.0


def test_prompts_too_long_or_answers_the_tokenizer_cannot_write_are_refused_for_the_tiny_model():
    with pytest.raises(TaskError, match=r"dataset 'leg_counting': its prompts run to \d+-\d+ tokens, over the"):
        run_task(task_options={"dataset": "leg_counting"})
    with pytest.raises(TaskError, match="answers use characters the model's tokenizer cannot write"):
        run_task(task_options={"dataset": "syllogism"}, data={"max_prompt_tokens": 1000})


def test_reward_pool_workers_score_with_the_prompts_entries(tmp_path):
    overrides = [*SMALL_RUN, ONE_LAYER, "steps=2", "checkpoint=false", f"out={tmp_path}", "reward.workers=1"]
    g, plan = api.plan(GRAPH, overrides=overrides, emit=lambda s: None)
    result = api.run(g, plan)
    assert len(result.metrics) == 2 and all("reward/exact" in m for m in result.metrics)


@pytest.mark.slow
def test_grpo_on_count_bits_raises_the_tiny_models_reward(tmp_path):
    """The example graph's defaults (count_bits, 1..15): with seed 0 the reward goes 0.048 -> 0.38 and the
    exact answers 0.002 -> 0.33 (first and last 10 of 80 steps, ~25 s): right answers, not guesses written
    side by side (which the dataset's partial credit would pay)."""
    overrides = ["steps=80", "seed=0", "progress=false", "checkpoint=false", f"out={tmp_path}", ONE_LAYER]
    g, plan = api.plan(GRAPH, overrides=overrides, emit=lambda s: None)
    metrics = api.run(g, plan).metrics
    rewards, exact = [m["reward"] for m in metrics], [m["reward/exact"] for m in metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"GRPO count_bits: reward {first:.3f} -> {last:.3f}, exact {mean(exact[:10]):.3f} -> {mean(exact[-10:]):.3f}")
    assert first < 0.1 and last > first + 0.2
    assert mean(exact[-10:]) > mean(exact[:10]) + 0.2
