"""How a response ends and what text rewards see: one set of rules for every generation engine.

An engine samples tokens its own way (flowrl's torch sampler, vLLM, transformers' ``generate``);
everything after that is decided here, once, so that two engines sampling the same policy
produce the same kind of rollout. An engine asks `ResponseRules.budget` how many tokens a row
may sample in a call, hands each row's new tokens (with their log-probs) to
`ResponseRules.extend`, and builds its `Rollout` with `to_rollout`; `responses_of` unpacks a
rollout's rows for `resume`.

The rules (``sampling`` is the model's resolved `SamplingSpec`):

- **Budget.** A response holds at most ``sampling.max_new_tokens`` tokens, EOS included. One call
  may sample fewer (a decode chunk of a partial or async rollout), and never past the model's
  context (``room``: its positions less the prompt and the response so far). Every row has its
  own budget: a batched sampler samples to the largest and the rule cuts each row at its own.
- **EOS.** Unless ``sampling.ignore_eos``, the first EOS among the new tokens ends the response.
  EOS is the tokenizer's ``eos_token_id`` and only that: not the extra end ids a model's
  generation config may list (vLLM would stop at those by default; its engine is told not to),
  so every engine stops at the same token. EOS belongs to the response: it is in the response
  mask and its log-prob is kept, because stopping is an action the policy takes and learns.
  Nothing sampled after it is kept (a sampler that goes on past EOS loses those tokens here).
  With ``ignore_eos`` EOS is an ordinary token and every row runs to its budget.
- **Stop strings.** ``sampling.stop``: the response ends at the first token after which the text
  holds a stop string that the new tokens completed (one that began in an earlier chunk counts;
  one inside text that was already there, such as an environment's reply, does not). The text
  keeps the stop string and is cut right after it; the token that completed it stays in the
  response (the trainer scores what was sampled), so a token that runs past the stop string
  keeps its characters in the tokens but not in the text. Matching is on the text rewards see
  (below), decoded over the whole response, so a stop string split across tokens or across
  resumed chunks is found. Engines sample to EOS or their budget and this rule cuts afterwards:
  the kept tokens are distributed exactly as if the sampler had stopped there. EOS or a stop
  string, whichever comes first, ends the response.
- **Finished.** A row is finished when it ended at EOS, at a stop string, at its budget
  (``max_new_tokens``) or at the end of the model's context; a row that only ran out of its
  call's chunk is unfinished and may resume. ``Response.reason`` says which: ``"eos"``,
  ``"stop"``, ``"length"``, or ``""`` (unfinished).
- **Text.** The response's tokens are decoded as a whole by the tokenizer, with every special
  token shown as its token string (``<s>``, ``<pad>``, ``<unk>``, ``<|im_start|>``, an EOS
  sampled under ``ignore_eos``); only the EOS that ended the response is left out, as it is the
  end marker rather than content. Why not skip special tokens: a reward must see everything the
  policy wrote and the trainer trains on. If special tokens decoded to nothing, a policy could pad
  or interleave an answer with them (``c<s>a<pad>b``) and score as the clean answer while
  learning to emit them; shown, each costs the reward what any stray characters cost, in every
  engine alike. (Decoding with the tokenizer rather than per piece keeps ordinary text exactly
  as ``tokenizer.decode`` writes it.)

The rules work on plain Python lists of one row at a time; only `to_rollout` builds tensors
(with `ragged`; `padded_rows` makes the token columns of `Sequences` from lists the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from flowrl.contract.data import Rollout
    from flowrl.contract.resolved import SamplingSpec

#: Why a response ended (``""``: it did not; it may resume).
EOS, STOP, LENGTH = "eos", "stop", "length"


class Response(NamedTuple):
    """One row's response so far: its tokens, their behaviour log-probs, whether and why it ended,
    and the text rewards see."""

    ids: list[int]
    logprobs: list[float]
    finished: bool = False
    reason: str = ""
    text: str = ""


@dataclass(frozen=True)
class ResponseRules:
    """The rules above for one tokenizer and one `SamplingSpec`."""

    eos_id: int
    sampling: SamplingSpec
    decode: Callable[[list[int]], str]  # token ids -> text, special tokens shown

    @classmethod
    def of(cls, tokenizer: Any, sampling: SamplingSpec) -> ResponseRules:
        """The rules for an HF tokenizer (its ``eos_token_id``; special tokens decoded as their strings)."""

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=False)

        return cls(eos_id=int(tokenizer.eos_token_id), sampling=sampling, decode=decode)

    # ------------------------------------------------------------ how many tokens a call may sample
    def budget(self, have: int, chunk: int | None = None, room: int | None = None) -> int:
        """New tokens a row holding ``have`` response tokens may sample in one call: what is left of
        ``max_new_tokens``, at most ``chunk`` (one decode chunk; None: no chunking) and at most
        ``room`` (positions left in the model's context; None: unlimited). 0: it may sample none."""
        left = self.sampling.max_new_tokens - have
        for cap in (chunk, room):
            if cap is not None:
                left = min(left, cap)
        return max(left, 0)

    # ------------------------------------------------------------ where a response ends
    def extend(
        self,
        before: Response,
        new_ids: Sequence[int],
        new_logprobs: Sequence[float],
        room: int | None = None,
    ) -> Response:
        """``before`` (a row's response so far, unfinished) continued by the tokens a sampler drew
        for it (and their log-probs): cut where the response ends, with its finished flag, reason
        and text. ``room``: positions the model's context had left for this row before these tokens
        (None: unlimited)."""
        if before.finished:  # an ended response takes no more tokens
            return before
        new = [int(t) for t in new_ids]
        if len(new_logprobs) < len(new):
            raise ValueError(f"{len(new)} new tokens but {len(new_logprobs)} log-probs")
        keep = min(len(new), self.budget(len(before.ids), room=room))
        reason = ""
        if not self.sampling.ignore_eos and self.eos_id in new[:keep]:
            keep, reason = new.index(self.eos_id, 0, keep) + 1, EOS
        ids = before.ids + new[:keep]
        text = self.decode(ids[:-1] if reason == EOS else ids)
        stop = self._stop(before.ids, new[: keep - 1] if reason == EOS else new[:keep], text)
        if stop is not None:
            k, text = stop
            keep, reason = k, STOP
            ids = before.ids + new[:keep]
        elif not reason and (
            len(ids) >= self.sampling.max_new_tokens or (room is not None and len(ids) - len(before.ids) >= room)
        ):
            reason = LENGTH
        logprobs = before.logprobs + [float(x) for x in new_logprobs[:keep]]
        return Response(ids=ids, logprobs=logprobs, finished=bool(reason), reason=reason, text=text)

    def text(self, ids: Sequence[int], ended_at_eos: bool) -> str:
        """What rewards see of a response with these tokens (its final EOS left out when it ended there)."""
        ids = list(ids)
        return self.decode(ids[:-1] if ended_at_eos and ids and ids[-1] == self.eos_id else ids)

    def _stop(self, before: list[int], new: list[int], text: str) -> tuple[int, str] | None:
        """(new tokens kept, the text cut after the stop string) when the new tokens complete a stop
        string in ``text`` (the decoded ``before + new``), else None."""
        stops = [s for s in self.sampling.stop if s]
        if not stops or not new:
            return None
        base = _common_prefix(self.decode(before), text) if before else 0
        if _first_end(text, stops, base) is None:
            return None
        lo, hi = 1, len(new)  # the fewest new tokens whose text holds one (decoding grows with the tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if _first_end(self.decode(before + new[:mid]), stops, base) is None:
                lo = mid + 1
            else:
                hi = mid
        cut = self.decode(before + new[:lo])
        end = _first_end(cut, stops, base)
        assert end is not None
        return lo, cut[:end]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _first_end(text: str, stops: list[str], base: int) -> int | None:
    """Where the earliest-ending stop string that ends after ``base`` ends in ``text``, or None."""
    ends = []
    for s in stops:
        at = text.find(s, max(0, base - len(s) + 1))
        if at >= 0:
            ends.append(at + len(s))
    return min(ends) if ends else None


# ------------------------------------------------------------ rows in and out of a Rollout
def responses_of(rollout: Rollout, rules: ResponseRules) -> list[Response]:
    """Each row of ``rollout`` as a `Response` (to continue the unfinished ones)."""
    seqs = rollout.sequences
    lengths = seqs.response_mask.sum(-1).long().tolist()
    ids, logprobs = seqs.response_ids.tolist(), rollout.logprobs.tolist()
    out = []
    for i, (k, finished) in enumerate(zip(lengths, rollout.finished.tolist())):
        row = ids[i][:k]
        reason = ""
        if finished:
            ended_at_eos = not rules.sampling.ignore_eos and bool(row) and row[-1] == rules.eos_id
            reason = EOS if ended_at_eos else LENGTH  # (a stop-string end reads as a length end: both are final)
        out.append(Response(row, logprobs[i][:k], bool(finished), reason, seqs.texts[i]))
    return out


def prompt_rows(prompt_ids: Tensor, prompt_mask: Tensor) -> list[list[int]]:
    """Each row's prompt tokens, without padding."""
    return [[t for t, m in zip(r, k) if m] for r, k in zip(prompt_ids.tolist(), prompt_mask.tolist())]


def to_rollout(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    responses: Sequence[Response],
    prompt_index: Tensor,
    *,
    version: int,
    greedy: bool,
    pad_id: int,
) -> Rollout:
    """The `Rollout` of these rows: prompts as given (left-padded), responses right-padded with
    ``pad_id`` (log-probs with 0), their texts and finished flags."""
    import torch

    from flowrl.contract.data import Rollout, Sequences

    width = max((len(r.ids) for r in responses), default=0)
    seqs = Sequences(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=ragged([r.ids for r in responses], width, pad_id, torch.long),
        response_mask=ragged([[1.0] * len(r.ids) for r in responses], width, 0.0, torch.float32),
        prompt_index=prompt_index,
        texts=tuple(r.text for r in responses),
        version=version,
    )
    return Rollout(
        sequences=seqs,
        logprobs=ragged([r.logprobs for r in responses], width, 0.0, torch.float32),
        finished=torch.tensor([r.finished for r in responses], dtype=torch.bool),
        greedy=greedy,
    )


def padded_rows(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows as `Sequences` holds them: (prompt_ids, prompt_mask) left-padded and
    (response_ids, response_mask) right-padded, each to its longest row."""
    import torch

    p_width = max((len(p) for p in prompts), default=0)
    r_width = max((len(r) for r in responses), default=0)
    return (
        ragged(prompts, p_width, pad_id, torch.long, left=True),
        ragged([[1] * len(p) for p in prompts], p_width, 0, torch.long, left=True),
        ragged(responses, r_width, pad_id, torch.long),
        ragged([[1.0] * len(r) for r in responses], r_width, 0.0, torch.float32),
    )


def ragged(values: list[list[Any]], width: int, fill: float, dtype: torch.dtype, left: bool = False) -> torch.Tensor:
    """Ragged rows as one [len(values), width] tensor (right-padded, or left-padded), built in one go."""
    import torch

    n = len(values)
    out = torch.full((n, width), fill, dtype=dtype)
    lengths = torch.tensor([len(v) for v in values], dtype=torch.long)
    total = int(lengths.sum())
    if total:
        rows = torch.repeat_interleave(torch.arange(n), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        cols = torch.arange(total) - torch.repeat_interleave(starts, lengths)
        if left:
            cols = cols + torch.repeat_interleave(width - lengths, lengths)
        out[rows, cols] = torch.tensor([x for v in values for x in v], dtype=dtype)
    return out
