"""Review of issue 22 (train on your data): the data task's handling of regex answers, datasets
folders with several splits, the verifier's name, and what loading reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.errors import ConfigError
from flowrl.specs import build_config
from flowrl.tasks.dataset import load


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


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
    # not at the first step's reward, after the run folder, the model and the plan are made
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(ConfigError, match="Did you mean 'math'"):
        load(build_config({"data": {"train": train, "verifier": "maths"}}))


def test_evaluation_with_verifier_none_is_refused_naming_the_evaluation(tmp_path):
    # evaluation scores with the verifier; the error must not tell a user who scores with their own
    # reward functions to "score with a reward function of your own"
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(ConfigError, match="eval.every"):
        load(build_config({"data": {"train": train, "verifier": "none", "val": train}, "eval": {"every": 5}}))
    load(build_config({"data": {"train": train, "verifier": "none"}}))  # no evaluation: fine


def test_the_report_names_no_validation_split_when_there_is_none(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "1"}])
    lines = load(build_config({"data": {"train": train}})).report.lines()
    assert lines == ["data train: 1 prompts of 1 rows"]  # no "data val: 0 prompts of 0 rows"


def test_truncation_cuts_the_text_as_written_not_through_decoded_tokens(tmp_path):
    # the tiny model's character tokenizer has no 'W': decoding its ids wrote '<unk>hat is' into the prompt
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
    # a row with an empty prompt (an empty jsonl string, a blank user turn) trained silently before
    rows = [{"prompt": "q", "answer": "1"}, {"prompt": prompt, "answer": "2"}]
    train = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(ConfigError, match="row 2: the .*empty"):
        load(build_config({"data": {"train": train}}))


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    # a latin-1 jsonl crashed in the resolve pass with a UnicodeDecodeError from pyarrow
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ConfigError, match="line 2 is not UTF-8"):
        load(build_config({"data": {"train": str(path)}}))
    csv = tmp_path / "latin.csv"
    csv.write_bytes(b"prompt,answer\ncaf\xe9,1\n")
    with pytest.raises(ConfigError, match="codec can't decode.*UTF-8"):  # not "An error occurred while generating"
        load(build_config({"data": {"train": str(csv)}}))


def test_an_empty_folder_is_no_datasets_folder(tmp_path):
    (tmp_path / "empty").mkdir()  # crashed: max() arg is an empty sequence
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
    # was: "line 1 is not valid JSON (Expecting property name ...); each line of a jsonl file holds one row"
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(value, indent=2))
    with pytest.raises(ConfigError, match=expected):
        load(build_config({"data": {"train": str(path)}}))
    lines = tmp_path / "lines.json"  # rows one per line, in a .json file: read as jsonl
    lines.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    assert len(load(build_config({"data": {"train": str(lines)}})).train) == 2


@pytest.mark.parametrize(
    "response",
    ["The answer is 18 dollars.", "The answer is **18**.", "#### 18 dollars", "So the answer is 18, since 9*2=18."],
)
def test_the_math_verifier_reads_a_stated_number_followed_by_words(response):
    from flowrl.tasks.verifiers import verify

    assert verify("math", response, "18") == 1.0


def test_data_val_without_eval_every_says_it_is_not_evaluated(tmp_path):
    # "data val: 1 prompts of 1 rows" was printed, and the rows were never used
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
    # an SFT-style conversation (question, then its answer): the template opened another assistant turn
    # after the answer, and the model was trained to write past it
    turns = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": turns, "answer": "2"}])
    with pytest.raises(ConfigError, match="row 1: the messages in 'prompt' end with an assistant turn"):
        load(build_config({"model": chat_model, "data": {"train": train}}))
