"""Preference pairs: a user's file of prompt, chosen and rejected columns (text or messages, with or
without a prompt column) becomes prompts with two completions, chosen then rejected, laid out as two
rows of one group; the built-in tasks give a pair of their own; bad rows are named."""

from __future__ import annotations

import json
import random

import pytest

from flowrl.contract.data import Completion
from flowrl.errors import ConfigError, GraphError
from flowrl.runtime.offline import offline_sequences
from flowrl.specs import DataConfig
from flowrl.tasks.builtin import BUILTIN_TASKS
from flowrl.tasks.dataset import DataReport, DataTask, _check_response_keys, read_rows, rows_to_prompts
from flowrl.tasks.tokenizer import build_tokenizer

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def _file(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _pairs(path: str, template: str | None = None, budget: int = 64, **fields):
    data = DataConfig(train=path, chosen_key="chosen", rejected_key="rejected", verifier="none", **fields)
    _check_response_keys(data)
    report = DataReport(budget=budget, response_overlong=data.overlong)
    prompts = rows_to_prompts("train", data, read_rows("train", data), build_tokenizer(), template, report, None)
    return prompts, report


def test_text_pairs_become_two_rows_of_one_group_chosen_then_rejected(tmp_path):
    path = _file(tmp_path, [{"prompt": "ab>", "chosen": "ab", "rejected": "ba", "answer": "ab", "id": 1},
                            {"prompt": "c>", "chosen": "c", "rejected": "cc"}])  # fmt: skip
    prompts, _ = _pairs(path)
    assert [p.text for p in prompts] == ["ab>", "c>"]
    assert prompts[0].completions == (
        Completion(pieces=("ab",), trained=(True,), eos=True),
        Completion(pieces=("ba",), trained=(True,), eos=True),
    )
    assert prompts[0].meta == {"id": 1} and prompts[0].answer == "ab"  # the responses are not metadata
    seqs, metrics = offline_sequences(prompts, DataTask(prompts, [], seed=0, shuffle=False, verifier="none",
                                                        budget=8), build_tokenizer(), 0, rows="pairs")  # fmt: skip
    assert seqs.prompt_index.tolist() == [0, 0, 1, 1] and seqs.texts == ("ab", "ba", "c", "cc")
    assert metrics["rows"] == 4


def test_conversational_pairs_train_the_assistant_turns_after_the_prompt_messages(tmp_path):
    user = [{"role": "user", "content": "ab"}]
    path = _file(tmp_path, [{"prompt": user, "chosen": [{"role": "assistant", "content": "ba"}],
                             "rejected": [{"role": "assistant", "content": "ab"}]}])  # fmt: skip
    (prompt,), _ = _pairs(path, TEMPLATE)
    assert prompt.text == "u:ab|a:"
    assert [c.text for c in prompt.completions] == ["ba|", "ab|"]
    assert all(c.trained == (True,) for c in prompt.completions)


def test_whole_conversations_without_a_prompt_column_share_their_first_turns_as_the_prompt(tmp_path):
    user = {"role": "user", "content": "ab"}
    path = _file(tmp_path, [{"chosen": [user, {"role": "assistant", "content": "ba"}],
                             "rejected": [user, {"role": "assistant", "content": "b"}]}])  # fmt: skip
    (prompt,), _ = _pairs(path, TEMPLATE)
    assert prompt.text == "u:ab|a:" and [c.text for c in prompt.completions] == ["ba|", "b|"]


@pytest.mark.parametrize(
    "row,message",
    [
        ({"prompt": "ab>", "chosen": "ab", "rejected": None}, "row 2 has no 'rejected' (data.rejected_key)"),
        ({"prompt": "ab>", "chosen": 7, "rejected": "b"}, "row 2: the response in 'chosen' (data.chosen_key) is int 7"),
        ({"prompt": "ab>", "chosen": " ", "rejected": "b"}, "the response in 'chosen' (data.chosen_key) is empty"),
        ({"prompt": "ab>", "chosen": "a", "rejected": [{"role": "assistant"}]},
         "row 2: message 1 of 'rejected' (data.rejected_key) must have text 'role' and 'content'"),
        ({"prompt": "ab>", "chosen": "a", "rejected": [{"role": "user", "content": "x"}]},
         "row 2: the response in 'rejected' must start with a non-empty assistant turn"),
    ],
)  # fmt: skip
def test_a_bad_pair_row_is_refused_naming_the_file_row_and_column(tmp_path, row, message):
    path = _file(tmp_path, [{"prompt": "ab>", "chosen": "ab", "rejected": "ba"}, row])
    with pytest.raises(ConfigError) as info:
        _pairs(path)
    assert f"data.train file '{path}'" in str(info.value) and message in str(info.value)


def test_a_pair_file_without_a_response_column_or_with_half_the_keys_is_refused(tmp_path):
    path = _file(tmp_path, [{"prompt": "ab>", "chosen": "ab", "loser": "ba"}])
    with pytest.raises(ConfigError, match=r"has no column 'rejected' \(data.rejected_key\).*columns: prompt, chosen"):
        _pairs(path)
    with pytest.raises(ConfigError, match="data.chosen_key is set and data.rejected_key is not"):
        _check_response_keys(DataConfig(chosen_key="chosen"))
    with pytest.raises(ConfigError, match="not both"):
        _check_response_keys(DataConfig(chosen_key="c", rejected_key="r", response_key="x"))


@pytest.mark.parametrize("overlong,kept", [("drop", 1), ("truncate", 2)])
def test_a_pair_with_a_response_over_the_budget_is_dropped_or_kept_to_be_cut(tmp_path, overlong, kept):
    path = _file(tmp_path, [{"prompt": "ab>", "chosen": "ab", "rejected": "ba"},
                            {"prompt": "ab>", "chosen": "ab", "rejected": "b" * 40}])  # fmt: skip
    prompts, report = _pairs(path, budget=8, overlong=overlong)
    assert len(prompts) == kept and report.long_responses["train"] == 1


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_a_built_in_task_prefers_its_answer_over_a_plausible_wrong_one_the_same_each_time(name):
    task = BUILTIN_TASKS[name]()
    for prompt in task.prompts(random.Random(3), 40):
        chosen, rejected = task.pairs(prompt)
        assert chosen.text == prompt.answer and rejected.text != prompt.answer and chosen.eos and rejected.eos
        assert task.pairs(prompt) == (chosen, rejected)  # drawn from the prompt: a resume reads the same pair
        if name != "expr":  # scored in a sandbox: slow; its wrong constant fails the asserts by construction
            assert task.score(prompt, rejected.text) < 1.0
        assert set(rejected.text) <= set("abcdefghijklmnopqrstuvwxyz0123456789+-*x")


def test_a_pairs_source_over_a_task_without_pairs_says_how_to_give_them():
    from flowrl.contract.data import Prompt

    class NoPairs:
        name = "plain"

    with pytest.raises(GraphError, match="data.chosen_key=COLUMN data.rejected_key=COLUMN"):
        offline_sequences([Prompt(text="a", answer="a")], NoPairs(), build_tokenizer(), 0, rows="pairs")


def test_data_pairs_makes_a_preference_file_from_gsm8k_rows_that_the_loader_reads(tmp_path, capsys):
    from flowrl.cli import main

    src, out = tmp_path / "train.jsonl", tmp_path / "pairs.jsonl"
    rows = [
        {"question": "Tom has 12 apples and gets 9 more. How many?", "answer": "12 + 9 = 21. #### 21", "source": "add"},
        {"question": "Li buys 3 bags of 4. How many?", "answer": "3 * 4 = 12. #### 12"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "pairs", str(src), "--out", str(out), "--slips", "work"]) == 0
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    assert pairs[0]["chosen"] == "12 + 9 = 21. The answer is 21." and pairs[0]["answer"] == "21"
    wrong = pairs[0]["rejected"].rsplit(" ", 1)[-1].rstrip(".")
    assert wrong != "21" and pairs[0]["rejected"] == f"12 + 9 = {wrong}. The answer is {wrong}."  # carried through
    assert pairs[0]["slip"] == "work" and pairs[0]["source"] == "add" and pairs[0]["prompt"] == rows[0]["question"]
    assert main(["data", "pairs", str(src), "--out", str(out), "--slips", "answer", "--force"]) == 0
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    assert pairs[0]["rejected"] == f"12 + 9 = 21. The answer is {wrong}." and pairs[0]["slip"] == "answer"
    assert main(["data", "pairs", str(src), "--out", str(out), "--force"]) == 0  # both kinds, one drawn per row
    first = out.read_text()
    assert main(["data", "pairs", str(src), "--out", str(out), "--force"]) == 0 and out.read_text() == first  # seeded
    prompts, _ = _pairs(str(out))
    assert [c.text for c in prompts[1].completions][0] == "3 * 4 = 12. The answer is 12."
    assert main(["data", "pairs", str(src), "--out", str(out), "--slips", "work,sign", "--force"]) == 2
    assert "--slips must be some of work, answer" in capsys.readouterr().err
    src.write_text(json.dumps({"question": "q", "answer": "no number #### many"}) + "\n")
    assert main(["data", "pairs", str(src), "--out", str(out), "--force"]) == 2
    assert "row 1: the answer's final part 'many' is not a number" in " ".join(capsys.readouterr().err.split())


def test_a_pair_whose_chosen_and_rejected_responses_are_the_same_is_dropped_and_counted(tmp_path):
    chat = [{"role": "user", "content": "ab>"}, {"role": "assistant", "content": "ab"}]
    path = _file(tmp_path, [{"prompt": "ab>", "chosen": "ab", "rejected": "ba"},
                            {"prompt": "ab>", "chosen": "ab", "rejected": "ab"},
                            {"chosen": chat, "rejected": chat}])  # fmt: skip
    prompts, report = _pairs(path, TEMPLATE)
    assert len(prompts) == 1  # a tie teaches nothing: its margin is 0 whatever the model does
    assert report.same_pairs["train"] == 2
    assert "2 pairs dropped as their chosen and rejected responses are the same" in report.lines()[0]


def test_a_file_of_tied_pairs_only_is_refused_saying_why(tmp_path):
    from flowrl.specs import build_config
    from flowrl.tasks.dataset import load

    path = _file(tmp_path, [{"prompt": "ab>", "chosen": "ab", "rejected": "ab"}] * 2)
    data = {"train": path, "chosen_key": "chosen", "rejected_key": "rejected", "verifier": "none"}
    cfg = build_config({"data": data})
    with pytest.raises(ConfigError, match="2 pairs whose chosen and rejected responses are the same"):
        load(cfg)


@pytest.mark.parametrize(
    "row,keys,column",
    [
        ({"question": "q", "answer": "1 + 1 = 2 #### 2", "chosen": "mine"}, [], "chosen"),
        ({"question": "q", "solution": "1 + 1 = 2 #### 2", "answer": "the worked text"}, ["--answer-key", "solution"],
         "answer"),
    ],
)  # fmt: skip
def test_data_pairs_refuses_a_row_whose_column_the_pair_would_overwrite(tmp_path, capsys, row, keys, column):
    from flowrl.cli import main

    src, out = tmp_path / "train.jsonl", tmp_path / "pairs.jsonl"
    src.write_text(json.dumps(row) + "\n")
    assert main(["data", "pairs", str(src), "--out", str(out), *keys]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"row 1 has a column '{column}'" in err and "overwrite" in err
    assert not out.exists()  # nothing written: no pair with another column's value in it


def test_a_held_out_file_with_no_pair_left_is_refused_not_replaced_by_training_rows(tmp_path):
    from flowrl.specs import build_config
    from flowrl.tasks.dataset import load

    train = _file(tmp_path, [{"prompt": "ab>", "chosen": "ab", "rejected": "ba"}] * 2)
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "ab>", "chosen": "ab", "rejected": "ab"}) + "\n")
    data = {"train": train, "val": str(val), "chosen_key": "chosen", "rejected_key": "rejected", "verifier": "none"}
    with pytest.raises(ConfigError, match="data.val: no prompt is left of 1 rows .1 pairs whose chosen and rejected"):
        load(build_config({"data": data, "eval": {"every": 5}}))
    assert load(build_config({"data": data})).val == []  # not evaluated (eval.every=0): nothing to refuse


@pytest.mark.parametrize(
    "graph,keys,want",
    [
        ("graphs/sft.py", ["data.response_key=null", "data.chosen_key=chosen", "data.rejected_key=rejected"], "one"),
        ("graphs/dpo.py", ["data.response_key=chosen", "data.chosen_key=null", "data.rejected_key=null"], "pairs"),
    ],
)
def test_a_source_whose_rows_the_data_columns_do_not_give_is_refused_at_plan_time(tmp_path, graph, keys, want):
    from flowrl import api
    from flowrl.errors import PlanError

    path = _file(tmp_path, [{"prompt": "ab>", "chosen": "ab", "rejected": "ba"}] * 4)
    with pytest.raises(PlanError) as err:
        api.plan(graph, overrides=[f"data.train={path}", "task=data", "rollout.prompts_per_step=2", *keys],
                 flags={"steps": 1}, emit=lambda s: None)  # fmt: skip
    message = str(err.value)
    assert "node 'data'" in message and ("data.chosen_key" if want == "pairs" else "data.response_key") in message


def test_pairs_mix_both_kinds_of_slip_one_drawn_per_row_from_the_seed():
    from flowrl.tasks.pairs import make_pairs

    rows = [{"question": f"Tom has {a} apples and gets 9 more.", "answer": f"{a} + 9 = {a + 9}. #### {a + 9}"}
            for a in range(40)]  # fmt: skip
    pairs = make_pairs(rows, seed=3)
    kinds = [p["slip"] for p in pairs]
    assert set(kinds) == {"work", "answer"} and 10 < kinds.count("work") < 30
    for row, pair in zip(rows, pairs):
        work = row["answer"].split(" ####")[0]
        wrong = pair["rejected"].rsplit(" ", 1)[-1].rstrip(".")
        assert wrong != pair["answer"]
        assert pair["rejected"].startswith(work) == (pair["slip"] == "answer")  # the work kept or slipped too
    assert make_pairs(rows, seed=3) == pairs and make_pairs(rows, seed=4) != pairs
    with pytest.raises(ValueError, match="slips must be some of work, answer"):
        make_pairs(rows, slips=())


@pytest.mark.parametrize(
    "work,final,slipped",
    [
        ("12 / 6 = 2. She has 12 left.", "2", "12 / 6 = {m}. She has 12 left."),  # not the 2 of 12
        ("10 - 9 = 1, leaving 1 apple and 11 pears.", "1", "10 - 9 = 1, leaving {m} apple and 11 pears."),
        ("It costs 1,000 - 0 = 1,000 dollars.", "1000", "It costs 1,000 - 0 = {m} dollars."),  # thousands commas
        ("Half is 2.50 dollars.", "2.5", "Half is {m} dollars."),
        ("3 - 8 = -5.", "-5", "3 - 8 = {m}."),
        ("48+24 = <<48+24=72>>72 clips.", "72", "48+24 = <<48+24={m}>>{m} clips."),  # GSM8K's calculator note too
    ],
)
def test_a_work_slip_replaces_the_last_whole_mention_of_the_answer(work, final, slipped):
    from flowrl.tasks.pairs import pair_of

    chosen, rejected, answer, kind = pair_of("q", f"{work} #### {final}", 0, ("work",))
    wrong = rejected.rsplit(" ", 1)[-1].rstrip(".")
    assert kind == "work" and answer == final.replace(",", "") and chosen == f"{work} The answer is {answer}."
    assert rejected == f"{slipped.format(m=wrong)} The answer is {wrong}."


@pytest.mark.parametrize("answer", ["#### 7", "The total is seven. #### 7"])
def test_an_answer_whose_work_does_not_show_its_number_is_an_answer_slip(answer):
    """Nothing in the work to carry the slip through: the row says what it is, an answer slip."""
    from flowrl.tasks.pairs import pair_of

    chosen, rejected, _, kind = pair_of("q", answer, 0, ("work",))
    assert kind == "answer" and rejected.endswith(".") and rejected != chosen


def test_the_kinds_of_slip_are_a_set_their_order_and_repeats_draw_the_same_pairs():
    from flowrl.tasks.pairs import make_pairs

    rows = [{"question": f"Tom has {i} apples and gets 2. How many?", "answer": f"{i} + 2 = {i + 2}. #### {i + 2}"}
            for i in range(60)]  # fmt: skip
    pairs = make_pairs(rows, seed=3, slips=("work", "answer"))
    assert make_pairs(rows, seed=3, slips=("answer", "work")) == pairs
    assert make_pairs(rows, seed=3, slips=("work", "work", "answer")) == pairs
    assert make_pairs(rows, seed=3) == pairs  # the default: both
    assert {p["slip"] for p in pairs} == {"work", "answer"}
    with pytest.raises(ValueError, match="slips must be some of work, answer; got wrok"):
        make_pairs(rows, slips=("wrok",))


@pytest.mark.parametrize("slips,message", [("", "got ''"), (" , ", "got ''"), ("work,wrok", "got 'work, wrok'")])
def test_data_pairs_refuses_slips_it_does_not_know_naming_them(tmp_path, capsys, slips, message):
    from flowrl.cli import main

    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2. #### 2"}) + "\n")
    code = main(["data", "pairs", str(src), "--out", str(tmp_path / "out.jsonl"), "--slips", slips])
    err = capsys.readouterr().err
    assert code != 0 and "--slips must be some of work, answer" in err and message in err
    assert not (tmp_path / "out.jsonl").exists()


def test_data_pairs_refuses_a_row_with_a_slip_column_of_its_own(tmp_path):
    from flowrl.tasks.pairs import make_pairs

    with pytest.raises(ValueError, match="row 1 has a column 'slip'"):
        make_pairs([{"question": "1 + 1?", "answer": "1 + 1 = 2. #### 2", "slip": "mine"}])
