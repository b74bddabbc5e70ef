"""The one set of generation rules (flowrl/contract/responses.py) on hand-built token rows: EOS in
the middle and at the budget, the budget, stop strings (within a chunk, across chunks, inside a
multi-character token, not in text that was already there), special tokens in the text, the
model's context end, and a response resumed in chunks ending exactly as one sampled at once."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.contract.resolved import SamplingSpec
from flowrl.contract.responses import EOS, LENGTH, STOP, Response, ResponseRules, prompt_rows, responses_of, to_rollout
from flowrl.tasks.tokenizer import build_tokenizer

TOK = build_tokenizer()
PAD, BOS, END, UNK = 0, 1, 2, 3  # flowrl's character tokenizer: <pad>, <s>, </s>, <unk>


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def rules(**sampling) -> ResponseRules:
    return ResponseRules.of(TOK, SamplingSpec(**{"max_new_tokens": 8, **sampling}))


def start() -> Response:
    return Response([], [])


def lps(n: int) -> list[float]:
    return [-0.5 - i for i in range(n)]


def test_the_first_eos_ends_the_response_is_kept_and_nothing_after_it():
    r = rules().extend(start(), [*ids("ab"), END, *ids("cd")], lps(5))
    assert r.ids == [*ids("ab"), END] and r.logprobs == lps(3)  # EOS in the mask, its log-prob kept
    assert r.finished and r.reason == EOS and r.text == "ab"  # the final EOS is not text


def test_eos_exactly_at_the_budget_is_an_eos_end():
    r = rules(max_new_tokens=3).extend(start(), [*ids("ab"), END], lps(3))
    assert r.reason == EOS and r.text == "ab" and len(r.ids) == 3


def test_the_budget_ends_a_response_and_cuts_what_a_sampler_drew_past_it():
    rule = rules(max_new_tokens=4)
    r = rule.extend(start(), ids("abcdef"), lps(6))
    assert r.ids == ids("abcd") and r.logprobs == lps(4)
    assert r.finished and r.reason == LENGTH and r.text == "abcd"
    assert rule.budget(0) == 4 and rule.budget(3) == 1 and rule.budget(4) == 0 and rule.budget(9) == 0
    assert rule.budget(0, chunk=2) == 2 and rule.budget(1, chunk=2, room=1) == 1 and rule.budget(0, room=-3) == 0


def test_a_chunk_that_runs_out_leaves_the_row_unfinished():
    r = rules().extend(start(), ids("ab"), lps(2))
    assert not r.finished and r.reason == "" and r.text == "ab"


def test_with_ignore_eos_eos_is_an_ordinary_token_and_shows():
    r = rules(max_new_tokens=5, ignore_eos=True).extend(start(), [*ids("ab"), END, *ids("cd"), END], lps(6))
    assert r.ids == [*ids("ab"), END, *ids("cd")] and r.reason == LENGTH and r.text == "ab</s>cd"
    r = rules(max_new_tokens=3, ignore_eos=True).extend(start(), [*ids("ab"), END], lps(3))
    assert r.reason == LENGTH and r.text == "ab</s>"  # a final EOS did not end it: it is content


def test_special_tokens_other_than_the_final_eos_show_in_the_text():
    """A reward sees every token the trainer trains on: 'c<s>' is not scored as 'c'."""
    row = [*ids("c"), BOS, *ids("a"), PAD, UNK, END]
    r = rules().extend(start(), row, lps(6))
    assert r.ids == row and r.reason == EOS and r.text == "c<s>a<pad><unk>"
    tok = copy.deepcopy(TOK)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    extra = tok.convert_tokens_to_ids("<|im_end|>")
    r = ResponseRules.of(tok, SamplingSpec(max_new_tokens=8)).extend(start(), [*ids("ab"), extra, END], lps(4))
    assert r.text == "ab<|im_end|>"


def test_a_stop_string_ends_the_response_keeping_the_stop_text():
    rule = rules(stop=("cd",))
    r = rule.extend(start(), [*ids("acdef"), END], lps(6))
    assert r.ids == ids("acd") and r.logprobs == lps(3) and r.finished and r.reason == STOP and r.text == "acd"
    r = rule.extend(start(), [*ids("ac"), END, *ids("d")], lps(4))  # EOS first: it ends the response
    assert r.reason == EOS and r.text == "ac"
    r = rules(stop=("zz", "b", "ab")).extend(start(), ids("xaby"), lps(4))  # the earliest end wins
    assert r.ids == ids("xab") and r.text == "xab"


def test_a_stop_string_across_chunks_is_found_but_not_one_in_text_already_there():
    rule = rules(stop=("cd",))
    first = rule.extend(start(), ids("ac"), lps(2))
    assert not first.finished
    r = rule.extend(first, ids("de"), lps(2))
    assert r.ids == ids("acd") and r.reason == STOP and r.text == "acd"
    env = Response(ids("cd|"), lps(3))  # e.g. an environment's reply in a multi-turn response
    r = rule.extend(env, ids("ab"), lps(2))
    assert not r.finished and r.text == "cd|ab"


def test_a_stop_string_inside_a_longer_token_cuts_the_text_not_the_token():
    pieces = {10: "ab", 11: "c\n\nx", 12: "yz", END: "</s>"}
    rule = ResponseRules(
        eos_id=END,
        sampling=SamplingSpec(max_new_tokens=8, stop=("\n\n",)),
        decode=lambda t: "".join(pieces[i] for i in t),
    )
    r = rule.extend(start(), [10, 11, 12, END], lps(4))
    assert r.ids == [10, 11] and r.reason == STOP and r.text == "abc\n\n"


def test_the_models_context_end_finishes_a_row():
    r = rules().extend(start(), ids("abcd"), lps(4), room=3)
    assert r.ids == ids("abc") and r.finished and r.reason == LENGTH
    r = rules().extend(Response(ids("ab"), lps(2)), [], [], room=0)
    assert r.finished and r.reason == LENGTH and r.text == "ab"
    assert rules().extend(r, ids("cd"), lps(2)) == r  # an ended response takes no more tokens


@pytest.mark.parametrize("sampling", [{}, {"stop": ("ca",)}, {"ignore_eos": True}, {"max_new_tokens": 5}])
@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_a_response_resumed_in_chunks_ends_as_one_sampled_at_once(sampling, cut):
    rule = rules(**sampling)
    row, logprobs = [*ids("abca"), END, *ids("dd")], lps(7)
    whole = rule.extend(start(), row, logprobs)
    first = rule.extend(start(), row[:cut], logprobs[:cut])
    parts = first if first.finished else rule.extend(first, row[cut:], logprobs[cut:])
    assert parts == whole


def test_rows_go_into_a_rollout_and_come_back():
    rule = rules(max_new_tokens=4)
    rows = [rule.extend(start(), [*ids("a"), END], lps(2)), rule.extend(start(), ids("bc"), lps(2))]
    prompt_ids = torch.tensor([[PAD, BOS, 5], [BOS, 6, 7]])
    prompt_mask = (prompt_ids != PAD).long()
    out = to_rollout(prompt_ids, prompt_mask, rows, torch.tensor([0, 1]), version=3, greedy=False, pad_id=PAD)
    seqs = out.sequences
    assert seqs.response_ids.tolist() == [[*ids("a"), END], ids("bc")]
    assert seqs.texts == ("a", "bc") and out.finished.tolist() == [True, False] and seqs.version == 3
    assert prompt_rows(prompt_ids, prompt_mask) == [[BOS, 5], [BOS, 6, 7]]
    back = responses_of(out, rule)
    assert [b.ids for b in back] == [r.ids for r in rows] and [b.text for b in back] == ["a", "bc"]
    assert back[0].reason == EOS and not back[1].finished
    assert back[0].logprobs == pytest.approx(rows[0].logprobs)
