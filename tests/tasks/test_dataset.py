"""The `data` task: the user's files through `datasets`, column mapping, chat templates, prompt
limits, seeded epochs, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flowrl.errors import ConfigError
from flowrl.specs import build_config
from flowrl.tasks.dataset import DataTask, load

ROWS = [
    {
        "question": f"What is {a} + {b}?",
        "answer": f"{a} + {b} = {a + b}. #### {a + b}",
        "source": "add" if a % 2 else "sum",
        "id": a,
    }
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14)]
]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def task(tmp_path: Path, model: str | None = None, rows: list[dict] | None = None, **data) -> DataTask:
    train = write_jsonl(tmp_path / "train.jsonl", rows or ROWS)
    cfg = build_config(
        {"model": model, "data": {"train": train, "prompt_key": "question", "answer_key": "answer", **data}}
    )
    return load(cfg)


def test_rows_become_prompts_with_ground_truth_metadata_and_the_chat_template(tmp_path, chat_model):
    t = task(tmp_path, chat_model, system_prompt="Think, then answer.")
    assert len(t.train) == len(ROWS)
    first = t.train[0]
    assert first.answer == "3"  # GSM8K's '#### 3'
    assert first.meta == {"source": "add", "id": 1}
    assert first.templated
    assert first.text == (
        "<|im_start|>system\nThink, then answer.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert t.report.templated and t.report.kept["train"] == len(ROWS)
    assert t.score(first, "so the answer is \\boxed{3}") == 1.0
    assert t.score(first, "the answer is 4") == 0.0


def test_without_a_template_the_text_goes_as_it_is(tmp_path, chat_model):
    t = task(tmp_path, chat_model, chat_template="none", system_prompt="Be brief.")
    assert not t.train[0].templated
    assert t.train[0].text == "Be brief.\n\nWhat is 1 + 2?"
    tiny = task(tmp_path)  # the tiny model's character tokenizer has no template: auto is none
    assert tiny.train[0].text == "What is 1 + 2?" and not tiny.train[0].templated


def test_a_template_file(tmp_path, chat_model):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    t = task(tmp_path, chat_model, chat_template=str(template))
    assert t.train[0].text == "[user] What is 1 + 2?\n[assistant]" and t.train[0].templated


def test_epochs_walk_every_row_once_each_in_a_seeded_order(tmp_path):
    t = task(tmp_path)
    n = len(ROWS)
    epoch0, epoch1 = t.take(0, n), t.take(n, n)
    assert sorted(p.text for p in epoch0) == sorted(p.text for p in t.train)
    assert sorted(p.text for p in epoch1) == sorted(p.text for p in t.train)
    assert [p.text for p in epoch0] != [p.text for p in epoch1]  # each epoch its own order
    # the stream is a function of the cursor: pieces taken in any split are the same prompts
    pieces = t.take(0, 3) + t.take(3, 5) + t.take(8, 6)
    assert [p.text for p in pieces] == [p.text for p in t.take(0, 14)]
    assert t.position(n + 2) == {"epoch": 1, "index": 2, "rows": n}
    plain = DataTask(t.train, [], seed=0, shuffle=False, verifier="math", budget=8)
    assert [p.text for p in plain.take(0, n)] == [p.text for p in t.train]


def test_every_file_format_reads_alike(tmp_path):
    import datasets

    table = datasets.Dataset.from_list(ROWS)
    table.to_csv(str(tmp_path / "train.csv"))
    table.to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "train.json").write_text(json.dumps(ROWS))
    table.save_to_disk(str(tmp_path / "saved"))
    texts = None
    for name in ("train.csv", "train.parquet", "train.json", "saved"):
        cfg = build_config({"data": {"train": str(tmp_path / name), "prompt_key": "question"}})
        got = [(p.text, p.answer) for p in load(cfg).train]
        texts = texts or got
        assert got == texts, name
    assert texts[2] == ("What is 5 + 6?", "11")


def test_messages_rows(tmp_path, chat_model):
    rows = [{"question": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "answer": "1"}]
    t = task(tmp_path, chat_model, rows=rows, system_prompt="ignored: the row has its own")
    assert t.train[0].text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


def test_long_prompts_are_dropped_and_counted_or_truncated(tmp_path, chat_model):
    rows = [dict(ROWS[0], question="What is 1 + 2? " * 30), *ROWS[1:3]]
    dropped = task(tmp_path, chat_model, rows=rows, max_prompt_tokens=40)
    assert len(dropped.train) == 2 and dropped.report.dropped_long["train"] == 1
    assert "1 dropped as longer than data.max_prompt_tokens" in dropped.report.lines()[0]
    cut = task(tmp_path, chat_model, rows=rows, max_prompt_tokens=40, overlong="truncate")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    assert len(cut.train) == 3 and cut.report.truncated["train"] == 1
    assert len(tok(cut.train[0].text, add_special_tokens=False)["input_ids"]) <= 40
    assert cut.train[0].text.endswith("<|im_start|>assistant\n")  # the template's end survives the cut


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "is empty"),
        ('{"question": "a", "answer": "1"}\n{"question": "b", answer: 2}\n', "line 2 is not valid JSON"),
        ('{"question": "a", "answer": "1"}\n[1, 2]\n', "line 2 is not a JSON object"),
        ('{"prompt": "a", "answer": "1"}\n', "has no column 'question' (data.prompt_key); its columns: prompt, answer"),
        ('{"question": "a", "label": "1"}\n', "has no column 'answer' (data.answer_key)"),
        ('{"question": 7, "answer": "1"}\n', "row 1: the prompt ('question') is int"),
        (
            '{"question": [{"role": "system", "content": "x"}], "answer": "1"}\n',
            "row 1: the messages in 'question' have no user turn",
        ),
    ],
)
def test_bad_files_are_named(tmp_path, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    cfg = build_config({"data": {"train": str(path), "prompt_key": "question"}})
    with pytest.raises(ConfigError, match="data.train file") as err:
        load(cfg)
    assert expected in str(err.value) and "bad.jsonl" in str(err.value)


def test_missing_file_unknown_format_and_a_conversation_without_template(tmp_path):
    with pytest.raises(ConfigError, match="'nope.jsonl' does not exist"):
        load(build_config({"data": {"train": "nope.jsonl"}}))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ConfigError, match="unknown format '.txt'"):
        load(build_config({"data": {"train": str(tmp_path / "x.txt")}}))
    rows = [
        {
            "prompt": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ],
            "answer": "1",
        }
    ]
    path = write_jsonl(tmp_path / "conv.jsonl", rows)
    with pytest.raises(ConfigError, match="needs a chat template"):
        load(build_config({"data": {"train": path}}))


def test_the_planner_sees_prompt_tokens_and_the_run_draws_by_cursor(tmp_path, chat_model):
    t = task(tmp_path, chat_model)
    assert 10 < t.prompt_tokens() < 40
    drawn = t.prompts(random.Random(0), 5)
    assert len(drawn) == 5 and all(p in t.train for p in drawn)
