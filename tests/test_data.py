"""The typed batches that cross layers (`flowrl.contract.data`): `Sequences.select` and `Rollout.select` keep
each row's tensors and text together, whether rows are picked by number or by a boolean mask (the
torch idiom for "the rows a filter kept")."""

from __future__ import annotations

import torch

from flowrl.contract.data import Rollout, Sequences


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
    assert s.texts == ("b", "c")  # not ('a', 'b', 'b'): texts indexed by the mask's values


def test_rollout_select_with_a_boolean_mask_keeps_rows_and_texts_together() -> None:
    seqs = sequences(("a", "b", "c"))
    rollout = Rollout(sequences=seqs, logprobs=torch.zeros(3, 1), finished=torch.tensor([True, False, True]))
    kept = rollout.select(rollout.finished)
    assert len(kept.sequences) == 2 and kept.sequences.texts == ("a", "c")
