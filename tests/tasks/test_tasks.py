"""Built-in toy tasks: prompts, answers, rewards, options."""

from __future__ import annotations

import random
import statistics

import pytest

from flowrl.errors import TaskError
from flowrl.tasks.builtin import (
    BUILTIN_TASKS,
    Add,
    Copy,
    Prompt,
    Repeat,
    Task,
    char_score,
    length_stats,
    make_task,
)
from flowrl.tasks.tokenizer import CHARS

NAMES = sorted(BUILTIN_TASKS)


@pytest.mark.parametrize("name", NAMES)
def test_registry_and_protocol(name: str) -> None:
    task = make_task(name)
    assert task.name == name
    assert task.description
    assert isinstance(task, Task)
    assert type(task) is BUILTIN_TASKS[name]


@pytest.mark.parametrize("name", NAMES)
def test_prompts_are_deterministic(name: str) -> None:
    task = make_task(name)
    a = task.prompts(random.Random(123), 50)
    b = task.prompts(random.Random(123), 50)
    c = task.prompts(random.Random(124), 50)
    assert a == b
    assert a != c
    assert len(a) == 50 and all(isinstance(p, Prompt) for p in a)
    assert task.prompts(random.Random(0), 0) == []


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_budget_covers_answers_and_exact_scores_one(name: str) -> None:
    task = make_task(name)
    for prompt in task.prompts(random.Random(5), 8 if name == "expr" else 500):  # expr: three sandbox runs each
        assert len(prompt.answer) + 2 <= task.max_new_tokens()
        assert set(prompt.text) <= set(CHARS) and set(prompt.answer) <= set(CHARS)
        assert task.score(prompt, prompt.answer) == 1.0
        assert task.score(prompt, "") == 0.0
        assert task.score(prompt, prompt.answer + "x") < 1.0


def test_add_answers() -> None:
    task = Add()
    assert task.score(Prompt(text="7+8=", answer="5"), "5") == 1.0
    for prompt in task.prompts(random.Random(0), 200):
        a, b = int(prompt.text[0]), int(prompt.text[2])
        assert prompt.text == f"{a}+{b}="
        assert prompt.answer == str((a + b) % 10)
    mod3 = Add(modulo=3)
    for prompt in mod3.prompts(random.Random(0), 200):
        a, b = int(prompt.text[0]), int(prompt.text[2])
        assert prompt.answer == str((a + b) % 3)


def test_copy_answers() -> None:
    task = Copy(alphabet_size=3, min_len=2, max_len=5)
    lengths = set()
    for prompt in task.prompts(random.Random(0), 300):
        assert prompt.text == prompt.answer + ">"
        assert set(prompt.answer) <= set("abc")
        lengths.add(len(prompt.answer))
    assert lengths == {2, 3, 4, 5}


def test_repeat_answers() -> None:
    for prompt in Repeat().prompts(random.Random(0), 300):
        letter, count = prompt.text[0], int(prompt.text[2:-1])
        assert prompt.text == f"{letter}*{count}="
        assert letter in "abcd"
        assert prompt.answer == letter * count
        assert 1 <= count <= 24


def test_repeat_long_tail() -> None:
    stats = length_stats(Repeat(), random.Random(0), n=2000)
    assert 2 <= stats["p50"] <= 4
    assert stats["max"] >= 6 * stats["p50"]
    assert stats["max"] <= 24
    assert stats["p50"] <= stats["p90"] <= stats["max"]


def test_length_stats_simple_tasks() -> None:
    assert length_stats(Add(), random.Random(0), n=100)["max"] == 1
    stats = length_stats(Copy(min_len=1, max_len=4), random.Random(0), n=500)
    assert stats["max"] == 4 and stats["prompt_max"] == 5


def test_char_score_hand_values() -> None:
    assert char_score("abc", "abc") == 1.0
    assert char_score("abc", "ab") == pytest.approx(0.9 * 2 / 3)
    assert char_score("ab", "abc") == pytest.approx(0.9 * 2 / 3)
    assert char_score("abc", "") == 0.0
    assert char_score("7", "8") == 0.0
    assert char_score("7", "7777") == pytest.approx(0.9 / 4)
    assert char_score("aaa", "aaaaaaaaa") < char_score("aaa", "aaaa") < 1.0
    assert char_score("abc", "xbc") == pytest.approx(0.9 * 2 / 3)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_random_policy_baseline_is_low(name: str) -> None:
    task = make_task(name)
    rng = random.Random(7)
    prompts = task.prompts(rng, 40 if name == "expr" else 2000)  # expr runs each in the sandbox
    scores = []
    for prompt in prompts:
        length = rng.randint(1, task.max_new_tokens())
        response = "".join(rng.choice(CHARS) for _ in range(length))
        scores.append(task.score(prompt, response))
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert statistics.fmean(scores) < 0.15


def test_make_task_unknown_name_lists_known() -> None:
    with pytest.raises(TaskError, match="unknown task 'mul'.*add, calc, copy, expr, repeat"):
        make_task("mul")


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [
        ("add", {"modulo": 1}, "modulo"),
        ("add", {"modulo": 11}, "modulo"),
        ("add", {"modulo": "10"}, "modulo"),
        ("add", {"modulus": 5}, "modulus"),
        ("copy", {"alphabet_size": 0}, "alphabet_size"),
        ("copy", {"alphabet_size": 27}, "alphabet_size"),
        ("copy", {"min_len": 0}, "min_len"),
        ("copy", {"min_len": 5, "max_len": 4}, "max_len"),
        ("repeat", {"sigma": -0.5}, "sigma"),
        ("repeat", {"median": 0}, "median"),
        ("repeat", {"max_count": 2}, "max_count"),
        ("repeat", {"median": 2.5}, "median"),
    ],
)
def test_make_task_bad_options_name_task_and_field(name: str, options: dict, field: str) -> None:
    with pytest.raises(TaskError) as info:
        make_task(name, options)
    message = str(info.value)
    assert repr(name) in message
    assert field in message


def test_make_task_options_and_direct_construction() -> None:
    assert make_task("repeat", {"median": 4, "sigma": 1}) == Repeat(median=4, sigma=1.0)
    assert make_task("add", None) == Add()
    with pytest.raises(TaskError, match="modulo"):
        Add(modulo=0)
    with pytest.raises(TaskError, match="options must be a mapping"):
        make_task("add", [("modulo", 5)])  # type: ignore[arg-type]
