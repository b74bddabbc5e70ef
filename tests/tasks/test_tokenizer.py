"""The character tokenizer: ids, special tokens, round-trips through save/load."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import transformers

from flowrl.tasks.builtin import BUILTIN_TASKS, make_task
from flowrl.tasks.tokenizer import CHARS, SPECIAL, build_tokenizer, save_tokenizer

SAMPLES = ["3+4=", "cab>", "b*17=", " a ,b  c>|", "x y", "  ", "k:1,2<3|z-9*0"]


@pytest.fixture(scope="module")
def tok() -> transformers.PreTrainedTokenizerFast:
    return build_tokenizer()


def test_vocabulary_layout(tok: transformers.PreTrainedTokenizerFast) -> None:
    assert len(set(CHARS)) == len(CHARS) == 46
    assert " " in CHARS
    assert len(tok) == len(SPECIAL) + len(CHARS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == list(SPECIAL)
    assert tok.padding_side == "left"


def test_one_token_per_char_with_bos(tok: transformers.PreTrainedTokenizerFast) -> None:
    ids = tok("3+4=", add_special_tokens=True)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + 4
    assert tok.eos_token_id not in ids
    assert tok("3+4=", add_special_tokens=False)["input_ids"] == ids[1:]
    spaced = tok("a b", add_special_tokens=False)["input_ids"]
    assert len(spaced) == 3 and spaced[1] == tok.convert_tokens_to_ids(" ")


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_encode_is_identity(tok: transformers.PreTrainedTokenizerFast, text: str) -> None:
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids[1:]) == text


def test_unknown_char_maps_to_unk(tok: transformers.PreTrainedTokenizerFast) -> None:
    assert tok("A", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_left_padding(tok: transformers.PreTrainedTokenizerFast) -> None:
    batch = tok(["1+1=", "abcd>"], padding=True)
    assert batch["input_ids"][0][0] == tok.pad_token_id
    assert batch["attention_mask"][0] == [0, 1, 1, 1, 1, 1]
    texts = tok.batch_decode(batch["input_ids"], skip_special_tokens=True)
    assert texts == ["1+1=", "abcd>"]


def test_save_load_round_trip(tok: transformers.PreTrainedTokenizerFast, tmp_path: Path) -> None:
    save_tokenizer(tmp_path / "tok")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2, 3)
    assert loaded.get_vocab() == tok.get_vocab()
    for text in SAMPLES:
        for special in (True, False):
            ids = tok(text, add_special_tokens=special)["input_ids"]
            assert loaded(text, add_special_tokens=special)["input_ids"] == ids
            assert loaded.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_task_text_has_no_unk(tok: transformers.PreTrainedTokenizerFast, name: str) -> None:
    big = {
        "add": {"modulo": 7},
        "copy": {"alphabet_size": 26, "max_len": 8},
        "repeat": {"alphabet_size": 26},
        "calc": {"low": 100, "high": 999},
        "expr": {"ops": ["mul"], "high": 3},
    }
    for options in ({}, big[name]):
        task = make_task(name, options)
        for prompt in task.prompts(random.Random(1), 300):
            for text in (prompt.text, prompt.answer):
                ids = tok(text, add_special_tokens=False)["input_ids"]
                assert tok.unk_token_id not in ids
                assert len(ids) == len(text)
                assert tok.decode(ids) == text
