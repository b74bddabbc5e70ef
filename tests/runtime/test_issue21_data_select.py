"""Issue 21: `flowrl.data.Sequences` is the public typed batch of responses (losses, filters and
plugins index it). `select` takes a row index tensor or a slice and slices the tensors with torch
indexing, but takes the texts by ``idx.tolist()``: with a boolean mask (the usual torch idiom for
"the rows a filter kept") the tensors hold the kept rows while ``texts`` holds texts[False] /
texts[True] for every row, the wrong texts and the wrong count; rewards would score other
responses. `Rollout.select` inherits it."""

from __future__ import annotations

import torch

from flowrl.data import Rollout, Sequences


def sequences(texts: tuple[str, ...]) -> Sequences:
    n = len(texts)
    return Sequences(
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        response_ids=torch.arange(n).view(n, 1) + 10,
        response_mask=torch.ones(n, 1),
        prompt_index=torch.arange(n),
        texts=texts,
    )


def test_select_with_row_numbers_keeps_rows_and_texts_together() -> None:
    s = sequences(("a", "b", "c")).select(torch.tensor([2, 0]))
    assert s.response_ids.flatten().tolist() == [12, 10] and s.texts == ("c", "a")


def test_select_with_a_boolean_mask_keeps_rows_and_texts_together() -> None:
    s = sequences(("a", "b", "c")).select(torch.tensor([False, True, True]))
    assert s.response_ids.flatten().tolist() == [11, 12]
    assert s.texts == ("b", "c")  # today ('a', 'b', 'b'): three texts for two rows


def test_rollout_select_with_a_boolean_mask_keeps_rows_and_texts_together() -> None:
    seqs = sequences(("a", "b", "c"))
    rollout = Rollout(sequences=seqs, logprobs=torch.zeros(3, 1), finished=torch.tensor([True, False, True]))
    kept = rollout.select(rollout.finished)
    assert len(kept.sequences) == 2 and kept.sequences.texts == ("a", "c")
