"""Offline rows: what a source node reads from the data becomes token rows with the assistant's
tokens trained (action mask 1) and the prompt's and chat template's not; bad rows are named."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.contract.data import Completion, Prompt
from flowrl.errors import ConfigError, GraphError
from flowrl.graph import Graph
from flowrl.runtime.offline import offline_sequences
from flowrl.specs import DataConfig
from flowrl.tasks.builtin import Copy
from flowrl.tasks.dataset import DataReport, read_rows, rows_to_prompts
from flowrl.tasks.tokenizer import build_tokenizer, vocab

# a chat template over the tiny tokenizer's characters: "u:TEXT|" per user turn, "a:TEXT|" per assistant turn
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def _ids(text: str) -> list[int]:
    table = vocab()
    return [table[c] for c in text]


def _rows(tmp_path, rows: list[dict], name: str = "train.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _prompts(data: DataConfig, template: str | None = None, budget: int = 64) -> tuple[list[Prompt], DataReport]:
    report = DataReport(budget=budget, response_overlong=data.overlong)
    prompts = rows_to_prompts("train", data, read_rows("train", data), build_tokenizer(), template, report, None)
    return prompts, report


def test_a_prompt_and_response_row_trains_the_response_and_the_end_token_only():
    tok = build_tokenizer()
    prompt = Copy().sample(__import__("random").Random(0))
    seqs, metrics = offline_sequences([prompt], Copy(), tok, 0, budget=16)
    assert seqs.prompt_ids[0].tolist() == [tok.bos_token_id, *_ids(prompt.text)]  # as the engines encode it
    assert seqs.response_ids[0].tolist() == [*_ids(prompt.answer), tok.eos_token_id]
    assert seqs.action_mask[0].tolist() == [1.0] * (len(prompt.answer) + 1)
    assert metrics["trained_tokens"] == len(prompt.answer) + 1 and metrics["truncated"] == 0


def test_a_conversation_trains_its_assistant_turns_and_not_the_user_turn_between(tmp_path):
    chat = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ba"},
        {"role": "user", "content": "cd"},
        {"role": "assistant", "content": "dc"},
    ]
    data = DataConfig(train=_rows(tmp_path, [{"prompt": chat}]), response_key="response", verifier="none")
    (prompt,), _ = _prompts(data, TEMPLATE)
    assert prompt.text == "u:ab|a:" and prompt.templated
    seqs, _ = offline_sequences([prompt], None, build_tokenizer(), 0)
    response = "ba|u:cd|a:dc|"
    tok = build_tokenizer()
    assert seqs.prompt_ids[0].tolist() == _ids("u:ab|a:")  # no BOS: the template wrote the text
    # the template writes no end-of-text token: it follows the last turn, as it ends a generated row
    assert seqs.response_ids[0].tolist() == [*_ids(response), tok.eos_token_id]
    trained = "".join(c for c, m in zip(response, seqs.action_mask[0].tolist()) if m)
    assert trained == "ba|dc|"  # the assistant's turns with their end-of-turn text; "u:cd|a:" is not trained
    assert seqs.action_mask[0].tolist()[-1] == 1.0  # and the end-of-text token


def test_a_response_column_with_a_chat_template_is_one_assistant_turn(tmp_path):
    path = _rows(tmp_path, [{"q": "ab", "r": "ba"}])
    data = DataConfig(train=path, prompt_key="q", response_key="r", verifier="none")
    (prompt,), _ = _prompts(data, TEMPLATE)
    assert prompt.completions == (Completion(pieces=("ba|",), trained=(True,), eos=True),)
    assert "r" not in prompt.meta  # the response is not metadata


@pytest.mark.parametrize(
    "row,message",
    [
        ({"prompt": "ab>"}, "row 2 has no 'response' (data.response_key)"),
        ({"prompt": "ab>", "response": 7}, "row 2: the response ('response') is int 7; it must be text"),
        ({"prompt": "ab>", "response": "  "}, "row 2: the response ('response') is empty"),
        ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]}, "message 2 of 'prompt'"),
        ({"prompt": [{"role": "assistant", "content": "ab"}]}, "row 2: the conversation in 'prompt' starts with an "
         "assistant turn"),
        ({"prompt": [{"role": "user", "content": "ab>"}]}, "row 2: the conversation in 'prompt' has no assistant turn "
         "to train on"),
    ],
)  # fmt: skip
def test_a_bad_row_is_refused_naming_the_file_row_and_column(tmp_path, row, message):
    path = _rows(tmp_path, [{"prompt": "ab>", "response": "ab"}, row])
    data = DataConfig(train=path, response_key="response", verifier="none")
    with pytest.raises(ConfigError) as info:
        _prompts(data)
    assert f"data.train file '{path}'" in str(info.value) and message in str(info.value)


def test_a_file_without_the_response_column_is_refused_naming_it(tmp_path):
    path = _rows(tmp_path, [{"prompt": "ab>", "answer": "ab"}])
    with pytest.raises(ConfigError, match=r"has no column 'response' \(data.response_key\).*columns: prompt, answer"):
        _prompts(DataConfig(train=path, response_key="response", verifier="none"))


@pytest.mark.parametrize("overlong,kept", [("drop", 1), ("truncate", 2)])
def test_a_response_over_the_budget_is_dropped_or_cut_and_counted(tmp_path, overlong, kept):
    path = _rows(tmp_path, [{"prompt": "ab>", "response": "ab"}, {"prompt": "ab>", "response": "a" * 40}])
    data = DataConfig(train=path, response_key="response", verifier="none", overlong=overlong)
    prompts, report = _prompts(data, budget=8)
    assert len(prompts) == kept and report.long_responses["train"] == 1
    assert "1 responses" in " ".join(report.lines())
    seqs, metrics = offline_sequences(prompts, None, build_tokenizer(), 0, budget=8)
    assert seqs.response_mask.sum(-1).max() <= 8 and metrics["truncated"] == kept - 1  # never a crash


def test_pairs_are_two_rows_of_one_group_chosen_first():
    chosen = Completion(pieces=("ab",), trained=(True,), eos=True)
    rejected = Completion(pieces=("ba",), trained=(True,), eos=True)
    prompts = [Prompt(text="ab>", answer="ab", completions=(chosen, rejected))] * 2
    seqs, _ = offline_sequences(prompts, None, build_tokenizer(), 0, rows="pairs")
    assert seqs.prompt_index.tolist() == [0, 0, 1, 1]
    assert seqs.texts == ("ab", "ba", "ab", "ba")
    with pytest.raises(GraphError, match="needs one response per prompt; the prompt 'ab>' has 2"):
        offline_sequences(prompts, None, build_tokenizer(), 0, rows="sft", node="data")


def test_a_source_is_a_node_kind_whose_key_trains_and_a_filter_cannot_keep_its_rows():
    g = Graph("sft")
    g.model("actor", "actor")
    g.source("data", writes="responses")
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    g.verify()
    assert g.sequence_keys() == {"responses"} and g.nodes["data"].kind == "source"
    g2 = Graph("bad")
    g2.model("actor", "actor")
    g2.source("data")
    g2.reward("r", fn="task")
    g2.filter("keep", fn="threshold", reads="rewards responses")
    g2.train("train_actor", model="actor", loss="sft", reads="responses")
    with pytest.raises(GraphError, match="filter 'keep' keeps rows of no generate node"):
        g2.verify()
    with pytest.raises(GraphError, match="rows must be one of sft, pairs"):
        Graph("x").source("data", rows="triples")  # type: ignore[arg-type]


def test_the_sft_loss_is_the_token_mean_nll_of_the_trained_tokens_only():
    from flowrl.algorithms.ops import sft_loss
    from flowrl.specs import AlgoConfig

    chat_seqs, _ = offline_sequences(
        [Prompt(text="u:ab|a:", answer="", templated=True, completions=(
            Completion(pieces=("ba|", "u:c|a:", "c|"), trained=(True, False, True)),))],
        None, build_tokenizer(), 0,
    )  # fmt: skip
    logprobs = -torch.arange(1.0, 1.0 + chat_seqs.response_ids.shape[1]).unsqueeze(0)
    loss, _ = sft_loss(logprobs, {"responses": chat_seqs}, AlgoConfig())
    mask = chat_seqs.action_mask[0]
    assert float(loss) == pytest.approx(float((-logprobs[0] * mask).sum() / mask.sum()))


def test_a_file_whose_every_response_is_over_the_budget_is_refused_naming_the_response_budget(tmp_path):
    from flowrl.specs import build_config
    from flowrl.tasks.dataset import load

    train = _rows(tmp_path, [{"prompt": "ab>", "response": "ab" * 40}] * 3)
    cfg = build_config(
        {"data": {"train": train, "response_key": "response", "verifier": "none"}, "rollout": {"max_new_tokens": 16}}
    )
    with pytest.raises(ConfigError) as err:
        load(cfg)
    message = str(err.value)
    assert "3 responses over the response budget (16 tokens" in message
    assert "rollout.max_new_tokens" in message and "data.overlong=truncate" in message
    assert "0 longer than" not in message  # the prompts are short: they are not why nothing is left


def test_a_given_response_ends_where_a_generated_one_does_so_a_reward_model_scores_the_same_token(tmp_path, chat_model):
    """ChatML writes ``<|im_end|>\\n`` after each turn; generation stops at ``<|im_end|>`` (the
    end-of-text token). A pair row must end there too, or a scalar head trained on pairs would read
    its score at the ``\\n`` and score generated rows at another token."""
    import transformers

    from flowrl.backends.local.packing import score_index

    tok = transformers.AutoTokenizer.from_pretrained(chat_model)
    path = _rows(tmp_path, [{"prompt": "2+3?", "chosen": "5", "rejected": "6"}])
    data = DataConfig(train=path, chosen_key="chosen", rejected_key="rejected", verifier="none")
    report = DataReport(budget=64, response_overlong=data.overlong)
    (prompt,) = rows_to_prompts("train", data, read_rows("train", data), tok, tok.chat_template, report, None)
    seqs, _ = offline_sequences([prompt], None, tok, tok.pad_token_id, rows="pairs")
    for row, answer in enumerate(("5", "6")):
        generated = [*tok(answer, add_special_tokens=False)["input_ids"], tok.eos_token_id]  # as an engine ends it
        response = [i for i, m in zip(seqs.response_ids[row].tolist(), seqs.response_mask[row].tolist()) if m]
        assert response == generated
        assert seqs.action_mask[row].sum() == len(generated)  # the answer and its end-of-text token, trained
    generated_row = torch.tensor([[*seqs.prompt_ids[0].tolist(), *generated]])
    ids = seqs.input_ids[1:2]
    assert ids.tolist() == generated_row.tolist()
    assert score_index(ids, seqs.attention_mask[1:2], tok.pad_token_id) == score_index(
        generated_row, torch.ones_like(generated_row), tok.pad_token_id
    )


def test_an_answer_quoting_the_end_of_text_token_is_kept_whole_when_the_template_writes_none(tmp_path):
    """The template writes no end-of-text token (as Gemma's ``<end_of_turn>`` with ``<eos>``): the one in
    the answer's own text is the answer's, so the row keeps all of it and the token is appended after."""
    path = _rows(tmp_path, [{"q": "ab", "r": "ab</s>ba"}])
    data = DataConfig(train=path, prompt_key="q", response_key="r", verifier="none")
    (prompt,), _ = _prompts(data, TEMPLATE)
    assert prompt.completions == (Completion(pieces=("ab</s>ba|",), trained=(True,), eos=True),)


def test_an_answer_quoting_the_end_of_text_token_ends_at_the_one_the_template_writes(tmp_path, chat_model):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(chat_model)
    path = _rows(tmp_path, [{"prompt": "2+3?", "response": "say <|im_end|> then 5"}])
    data = DataConfig(train=path, response_key="response", verifier="none")
    report = DataReport(budget=64, response_overlong=data.overlong)
    (prompt,) = rows_to_prompts("train", data, read_rows("train", data), tok, tok.chat_template, report, None)
    assert prompt.completions == (Completion(pieces=("say <|im_end|> then 5<|im_end|>",), trained=(True,)),)


def test_turns_after_the_last_assistant_turn_are_left_out_so_the_row_ends_as_a_generated_one(tmp_path, chat_model):
    """A conversation ending with a tool or user turn: nothing after the last answer is trained, and the
    row ends at the answer's end-of-text token, where generation stops and a reward model reads its score."""
    import transformers

    chat = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}, {"role": "tool", "content": "c"}]
    path = _rows(tmp_path, [{"prompt": chat}])
    data = DataConfig(train=path, response_key="response", verifier="none")
    (prompt,), _ = _prompts(data, TEMPLATE)  # the template writes no end-of-text token: it is appended
    assert prompt.completions == (Completion(pieces=("ba|",), trained=(True,), eos=True),)
    tok = transformers.AutoTokenizer.from_pretrained(chat_model)
    report = DataReport(budget=64, response_overlong=data.overlong)
    (prompt,) = rows_to_prompts("train", data, read_rows("train", data), tok, tok.chat_template, report, None)
    assert prompt.completions == (Completion(pieces=("ba<|im_end|>",), trained=(True,)),)
    seqs, _ = offline_sequences([prompt], None, tok, tok.pad_token_id)
    assert seqs.response_ids[0].tolist() == [*tok("ba", add_special_tokens=False)["input_ids"], tok.eos_token_id]
