"""The `data` task: the user's files through `datasets`, column mapping, chat templates, prompt
limits, seeded epochs, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import write_jsonl

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


# ---------------------------------------------------------------- edges of reading the data


def test_a_regex_ground_truth_is_kept_as_written(tmp_path):
    # the math reading of a ground truth (text after '####', thousands separators dropped, stripped)
    # must not touch a pattern: \d{1,100} would become \d{1100}, and 'x #### ' an empty pattern
    rows = [{"prompt": "digits?", "answer": r"^\d{1,100}$"}, {"prompt": "tail?", "answer": "ends #### ok "}]
    cfg = build_config({"data": {"train": write_jsonl(tmp_path / "rx.jsonl", rows), "verifier": "regex"}})
    task = load(cfg)
    assert [p.answer for p in task.train] == [r"^\d{1,100}$", "ends #### ok "]
    assert task.score(task.train[0], "12345") == 1.0
    assert task.score(task.train[1], "no match") == 0.0


def test_a_datasets_folder_never_gives_its_train_split_as_data_val(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "gsm"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"prompt": ["t1", "t2"], "answer": ["1", "2"]}),
            "test": datasets.Dataset.from_dict({"prompt": ["v1"], "answer": ["3"]}),
        }
    ).save_to_disk(str(folder))
    task = load(build_config({"data": {"train": str(folder), "val": str(folder)}}))
    assert [p.text for p in task.train] == ["t1", "t2"]
    assert [p.text for p in task.val] == ["v1"]  # its test split, not a copy of the training rows

    only_train = tmp_path / "only"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["t"], "answer": ["1"]})}).save_to_disk(
        str(only_train)
    )
    with pytest.raises(ConfigError, match="splits train"):
        load(build_config({"data": {"train": str(folder), "val": str(only_train)}}))


def test_an_unknown_verifier_is_refused_when_the_data_is_read(tmp_path):
    # when the data is read, before the run folder, the model and the plan are made
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(ConfigError, match="Did you mean 'math'"):
        load(build_config({"data": {"train": train, "verifier": "maths"}}))


def test_evaluation_with_verifier_none_is_refused_naming_the_evaluation(tmp_path):
    # evaluation scores with the verifier (the message names the evaluation, not the user's rewards)
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(ConfigError, match="eval.every"):
        load(build_config({"data": {"train": train, "verifier": "none", "val": train}, "eval": {"every": 5}}))
    load(build_config({"data": {"train": train, "verifier": "none"}}))  # no evaluation: fine


def test_the_report_names_no_validation_split_when_there_is_none(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "1"}])
    lines = load(build_config({"data": {"train": train}})).report.lines()
    assert lines == ["data train: 1 prompts of 1 rows"]  # no "data val: 0 prompts of 0 rows"


def test_truncation_cuts_the_text_as_written_not_through_decoded_tokens(tmp_path):
    # the tiny model's character tokenizer has no 'W': decoding its ids would write '<unk>hat is'
    rows = [{"prompt": "What is 2+2? " * 10, "answer": "4"}, {"prompt": "Ünïcödé 日本語 " * 10, "answer": "1"}]
    train = write_jsonl(tmp_path / "t.jsonl", rows)
    task = load(build_config({"data": {"train": train, "max_prompt_tokens": 20, "overlong": "truncate"}}))
    assert task.report.truncated["train"] == 2
    for prompt, row in zip(task.train, rows):
        assert prompt.text and row["prompt"].startswith(prompt.text)  # a prefix of the row's own text
        assert "<unk>" not in prompt.text and "\ufffd" not in prompt.text


def test_a_conversation_too_long_to_truncate_names_its_earlier_turns(tmp_path, chat_model):
    turns = [
        {"role": "user", "content": "hi " * 10},
        {"role": "assistant", "content": "hello " * 10},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": turns, "answer": "2"}])
    cfg = build_config({"model": chat_model, "data": {"train": train, "max_prompt_tokens": 20, "overlong": "truncate"}})
    with pytest.raises(ConfigError, match="earlier turns"):
        load(cfg)


@pytest.mark.parametrize(
    "prompt",
    ["", "   \n", [{"role": "system", "content": "S"}, {"role": "user", "content": ""}]],
)
def test_an_empty_prompt_is_named_not_trained_on(tmp_path, prompt):
    # a row with an empty prompt (an empty jsonl string, a blank user turn) is refused, naming the row
    rows = [{"prompt": "q", "answer": "1"}, {"prompt": prompt, "answer": "2"}]
    train = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(ConfigError, match="row 2: the .*empty"):
        load(build_config({"data": {"train": train}}))


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    # a latin-1 jsonl is named with its line (not pyarrow's UnicodeDecodeError in the resolve pass)
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ConfigError, match="line 2 is not UTF-8"):
        load(build_config({"data": {"train": str(path)}}))
    csv = tmp_path / "latin.csv"
    csv.write_bytes(b"prompt,answer\ncaf\xe9,1\n")
    with pytest.raises(ConfigError, match="codec can't decode.*UTF-8"):  # not "An error occurred while generating"
        load(build_config({"data": {"train": str(csv)}}))


def test_an_empty_folder_is_no_datasets_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a datasets.save_to_disk folder"):
        load(build_config({"data": {"train": str(tmp_path / "empty")}}))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"version": 1, "data": [{"prompt": "a", "answer": "1"}]}, "holds one JSON object \\(keys: version, data\\)"),
        ({"prompt": ["a", "b"], "answer": ["1", "2"]}, "holds columns \\(prompt, answer\\), each a list"),
    ],
)
def test_an_indented_json_object_is_named_as_one_not_as_a_broken_jsonl_line(tmp_path, value, expected):
    # not "line 1 is not valid JSON (Expecting property name ...); each line of a jsonl file holds one row"
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(value, indent=2))
    with pytest.raises(ConfigError, match=expected):
        load(build_config({"data": {"train": str(path)}}))
    lines = tmp_path / "lines.json"  # rows one per line, in a .json file: read as jsonl
    lines.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    assert len(load(build_config({"data": {"train": str(lines)}})).train) == 2


def test_data_val_without_eval_every_says_it_is_not_evaluated(tmp_path):
    # rows given for evaluation that no evaluation uses are reported as such
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "1"}])
    quiet = load(build_config({"data": {"train": train, "val": train}})).report.lines()
    assert quiet[1].startswith("data val: 1 prompts of 1 rows") and "not evaluated: eval.every is 0" in quiet[1]
    every = load(build_config({"data": {"train": train, "val": train}, "eval": {"every": 2}})).report.lines()
    assert every[1] == "data val: 1 prompts of 1 rows"


def test_truncation_that_keeps_no_character_is_refused_not_an_empty_prompt(tmp_path, chat_model):
    # a CJK character is three byte tokens here: a limit of 2 fits none of the text
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "日本語" * 20, "answer": "1"}])
    data = {"train": train, "max_prompt_tokens": 2, "overlong": "truncate", "chat_template": "none"}
    with pytest.raises(ConfigError, match="no room for even one character"):
        load(build_config({"model": chat_model, "data": data}))
    data["max_prompt_tokens"] = 3
    assert load(build_config({"model": chat_model, "data": data})).train[0].text == "日"


def test_messages_ending_with_the_assistant_answer_are_named(tmp_path, chat_model):
    # an SFT-style conversation (question, then its answer): the template would open another assistant
    # turn after the answer, and the model would learn to write past it
    turns = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": turns, "answer": "2"}])
    with pytest.raises(ConfigError, match="row 1: the messages in 'prompt' end with an assistant turn"):
        load(build_config({"model": chat_model, "data": {"train": train}}))
