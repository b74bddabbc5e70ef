"""Offline rows: the responses a source node reads from the data instead of generating them.

A prompt's given continuations (`flowrl.contract.data.Completion`: pieces of rendered text, each
trained or not) become token rows as generation would have written them (`Sequences`): the
prompt's tokens (left-padded; never trained), then the response's, with an action mask of 1 on
the assistant's tokens (and the end-of-text token that follows a response without a chat
template) and 0 on the chat template's text and other roles' turns. Losses cover the action
mask (``Sequences.sampled_mask``), so the ``sft`` loss is the token-mean NLL of the assistant's
tokens.

- ``rows="sft"``: one row per prompt (its demonstration).
- ``rows="pairs"``: two rows per prompt, the chosen response then the rejected one, in one group
  (``prompt_index``), as a generate node's ``n=2`` lays out its samples: a reward-model or DPO
  loss reads row ``2i`` against row ``2i+1``.

A response longer than the response budget (``rollout.max_new_tokens``: what the plan sized the
train step by) is cut at the budget and counted (``truncated``); a row is never dropped here (the
data loader drops or truncates by ``data.overlong`` when it reads the files).

Where the completions come from: a task's ``completions(prompt)`` (the ``data`` task: the rows'
response column or conversation turns; a built-in toy task: its correct answer, a demonstration
a tiny model can learn from scratch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flowrl.contract.data import Completion, Prompt, Sequences
from flowrl.contract.responses import padded_rows, ragged
from flowrl.errors import GraphError

#: Rows per prompt of each kind of source.
ROWS_PER_PROMPT = {"sft": 1, "pairs": 2}


def completions_of(task: Any, prompt: Prompt, rows: str, node: str) -> tuple[Completion, ...]:
    """The given continuations of ``prompt`` a source of ``rows`` trains on (one for sft; chosen,
    rejected for pairs), from the prompt or its task; errors name the node and say how to give them."""
    given = prompt.completions
    if not given:  # a task's own: its demonstration (completions) or its preference pair (pairs)
        method = getattr(task, "pairs" if rows == "pairs" else "completions", None)
        given = tuple(method(prompt)) if callable(method) else ()
    name = getattr(task, "name", type(task).__name__)
    if not given:
        how = (
            "--set data.chosen_key=COLUMN data.rejected_key=COLUMN"
            if rows == "pairs"
            else "--set data.response_key=COLUMN (or conversations in data.prompt_key)"
        )
        raise GraphError(
            f"node '{node}' reads responses from the data, and task '{name}' gives none for the prompt "
            f"{prompt.text[:60]!r}: train on your files with --data FILE and {how}, or use a task with answers "
            "(e.g. copy)."
        )
    want = ROWS_PER_PROMPT[rows]
    if len(given) != want:
        what = "one response" if want == 1 else "a chosen and a rejected response"
        how = (
            "give the data's chosen and rejected columns with --set data.chosen_key=COLUMN data.rejected_key=COLUMN"
            if want == 2
            else "give one response column with --set data.response_key=COLUMN"
        )
        raise GraphError(
            f"node '{node}' (rows={rows}) needs {what} per prompt; the prompt {prompt.text[:60]!r} has {len(given)}: "
            f"{how}."
        )
    return given


def tokens_of(tokenizer: Any, completion: Completion) -> tuple[list[int], list[float]]:
    """A completion's token ids and, per token, 1.0 when trained (each piece tokenized on its own,
    without special tokens, so a piece's tokens are its own; the end-of-text token last when asked)."""
    ids: list[int] = []
    trained: list[float] = []
    for piece, train in zip(completion.pieces, completion.trained):
        if not piece:
            continue
        piece_ids = list(tokenizer(piece, add_special_tokens=False)["input_ids"])
        ids += piece_ids
        trained += [1.0 if train else 0.0] * len(piece_ids)
    if completion.eos and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
        trained.append(1.0)
    return ids, trained


def prompt_tokens(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's tokens as the engines encode it (special tokens unless a chat template wrote them)."""
    return list(tokenizer(prompt.text, add_special_tokens=not prompt.templated)["input_ids"])


def offline_sequences(
    prompts: Sequence[Prompt],
    task: Any,
    tokenizer: Any,
    pad_id: int,
    *,
    rows: str = "sft",
    budget: int | None = None,
    node: str = "source",
) -> tuple[Sequences, dict[str, Any]]:
    """The token rows of ``prompts``' given responses (``ROWS_PER_PROMPT[rows]`` per prompt, in
    prompt order) and the source's metrics; responses cut at ``budget`` tokens (None: not cut)."""
    prompt_ids: list[list[int]] = []
    response_ids: list[list[int]] = []
    masks: list[list[float]] = []
    texts: list[str] = []
    index: list[int] = []
    truncated = 0
    for i, prompt in enumerate(prompts):
        ids = prompt_tokens(tokenizer, prompt)
        for completion in completions_of(task, prompt, rows, node):
            resp, mask = tokens_of(tokenizer, completion)
            if budget is not None and len(resp) > budget:
                resp, mask = resp[:budget], mask[:budget]
                truncated += 1
            prompt_ids.append(ids)
            response_ids.append(resp)
            masks.append(mask)
            texts.append(completion.text)
            index.append(i)
    p_ids, p_mask, r_ids, r_mask = padded_rows(prompt_ids, response_ids, pad_id)
    action = ragged(masks, r_ids.shape[1], 0.0, torch.float32)
    seqs = Sequences(
        prompt_ids=p_ids,
        prompt_mask=p_mask,
        response_ids=r_ids,
        response_mask=r_mask,
        prompt_index=torch.tensor(index, dtype=torch.long),
        texts=tuple(texts),
        action_mask=action,
    )
    trained = int(action.sum())
    metrics: dict[str, Any] = {
        "rows": len(texts),
        "response_length": round(float(r_mask.sum(-1).mean()), 3) if texts else 0.0,
        "trained_tokens": trained,
        "truncated": truncated,
        "sample": f"{prompts[0].text}{texts[0]}" if texts else "",
    }
    return seqs, metrics


def mean_nll(logprobs: torch.Tensor, seqs: Sequences) -> tuple[float, int]:
    """The mean negative log-likelihood per trained token of ``seqs`` and how many tokens it is over."""
    mask = seqs.sampled_mask.to(logprobs.dtype)
    count = int(mask.sum())
    if count == 0:
        return 0.0, 0
    return float(-(logprobs * mask).sum() / count), count
