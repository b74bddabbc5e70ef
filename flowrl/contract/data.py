"""The typed data that crosses module boundaries, in one place.

- `Prompt`: one task instance (what the model sees, the reference answer); `Completion`: a given
  continuation of a prompt (offline rows: a demonstration, one side of a preference pair).
- `Turn`, `ToolCall`: one turn of a multi-turn episode (the model's, or the environment's), and a
  tool call parsed from a model turn; `EpisodeText`: a response as reward functions see it, with its turns.
- `Sequences`: prompt + response token rows of one batch of responses (one constructor path:
  every copy, slice, trim and concatenation goes through `Sequences.replaced`).
- `Rollout`: what a generation engine returns (sequences, behaviour log-probs, finished rows).
- `Part`: a streamed part of a step's responses (finished groups, with their prompts).
- `GenerateResult`: one generate task's result for one step.
- `StepBatch`: the values a train step reads, by key, with the step's facts (the policy version
  the proximal log-probs were computed with).

This module imports no torch at load time (the planner and the CLI's error paths read `Prompt`);
the tensor methods import it when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch
    from torch import Tensor


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A given continuation of a prompt, read from data rather than generated (an offline source:
    `flowrl.runtime.offline`): its text after the prompt's, in ``pieces`` as the chat template
    rendered them, each ``trained`` or not (the assistant's turns with their end-of-turn tokens are;
    other roles' turns and the template's text between turns are not). ``eos``: the tokenizer's
    end-of-text token follows, trained, so the model learns to stop (text without a chat template)."""

    pieces: tuple[str, ...]
    trained: tuple[bool, ...]
    eos: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One task instance: what the model sees and the reference answer.

    ``meta`` holds a dataset row's other columns (reward functions read them: ``prompt.meta``);
    ``templated`` says ``text`` was rendered by a chat template and holds its special tokens, so
    engines encode it without adding the tokenizer's own (a second BOS)."""

    text: str
    answer: str
    meta: dict[str, Any] = {}
    templated: bool = False
    messages: tuple[dict[str, str], ...] = ()  # the chat turns ``text`` was rendered from (templated prompts)
    # offline rows: the given continuations (one demonstration; a preference pair: chosen, then rejected)
    completions: tuple[Completion, ...] = ()


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call parsed from a model turn: the tool's name and its arguments (JSON values)."""

    name: str
    arguments: dict[str, Any] = {}


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of an episode. ``role``: ``assistant`` (the model's: sampled, trained on), ``tool``
    (tool results the environment wrote, rendered by the chat template) or ``env`` (other text it
    wrote). ``reward``: the environment's reward for the model turn before it (on its own turns);
    ``tokens``: how many response tokens the turn holds."""

    role: str
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    reward: float = 0.0
    tokens: int = 0


class EpisodeText(str):
    """A multi-turn response as reward functions receive it: the whole text (a ``str``), with its
    ``turns`` (`Turn`s: the model's and the environment's, in order)."""

    turns: tuple[Turn, ...]

    def __new__(cls, text: str, turns: Sequence[Turn]) -> EpisodeText:
        out = super().__new__(cls, text)
        out.turns = tuple(turns)
        return out

    def __reduce__(self) -> tuple[Any, ...]:  # to reward pool workers
        return (EpisodeText, (str(self), self.turns))

    @property
    def final(self) -> str:
        """The model's last turn (its final answer)."""
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")

    @property
    def env_reward(self) -> float:
        """The sum of the rewards the environment gave over the episode."""
        return float(sum(t.reward for t in self.turns))


def adds_special_tokens(prompts: Sequence[Prompt]) -> bool:
    """Whether engines encode ``prompts`` with the tokenizer's special tokens (not when a chat
    template already wrote them)."""
    return not any(p.templated for p in prompts)


#: Sequences' fields by how they are laid out: prompt columns (left-padded), response columns
#: (right-padded, aligned with the response tokens) with their padding value (None: the pad id),
#: and one value per row.
PROMPT_FIELDS: dict[str, float | None] = {"prompt_ids": None, "prompt_mask": 0}
RESPONSE_FIELDS: dict[str, float | None] = {
    "response_ids": None,
    "response_mask": 0.0,
    "logprobs": 0.0,
    "versions": 0,
    "action_mask": 0.0,
}
ROW_FIELDS = ("prompt_index",)


@dataclass(frozen=True)
class Sequences:
    """Prompt + response token rows: prompts left-padded, responses right-padded."""

    prompt_ids: Tensor  # [B, P] long
    prompt_mask: Tensor  # [B, P] long, 1 for real prompt tokens
    response_ids: Tensor  # [B, R] long
    response_mask: Tensor  # [B, R] float, 1 for generated tokens (EOS included)
    prompt_index: Tensor  # [B] long: which prompt of the step this row answers (the group)
    texts: tuple[str, ...]  # decoded responses (what rewards see)
    version: int = 0  # weight version of the model that generated them (the oldest, when they span several)
    logprobs: Tensor | None = None  # [B, R] behaviour log-prob of each response token (None: not generated here)
    versions: Tensor | None = None  # [B, R] long: the weight version that sampled each response token
    # [B, R] float: 1 for the tokens the model sampled, 0 for what an environment wrote into the
    # response (multi-turn); None: every response token was sampled
    action_mask: Tensor | None = None
    # per row, the episode's turns (multi-turn generation); None: single-turn responses
    episodes: tuple[tuple[Turn, ...], ...] | None = None

    # ------------------------------------------------------------ the one constructor path
    def replaced(
        self,
        *,
        prompt: Callable[[Tensor, float | None], Tensor] | None = None,
        response: Callable[[Tensor, float | None], Tensor] | None = None,
        row: Callable[[Tensor], Tensor] | None = None,
        texts: Sequence[str] | None = None,
        **values: Any,
    ) -> Sequences:
        """A copy with ``prompt`` applied to every prompt column, ``response`` to every response
        column (present ones), ``row`` to every per-row value (each gets the column and its padding
        value), new ``texts`` and any field set by name."""
        changes: dict[str, Any] = {}
        for fn, group in ((prompt, PROMPT_FIELDS), (response, RESPONSE_FIELDS)):
            if fn is not None:
                for name, fill in group.items():
                    value = getattr(self, name)
                    changes[name] = None if value is None else fn(value, fill)
        if row is not None:
            changes.update({name: row(getattr(self, name)) for name in ROW_FIELDS})
        if texts is not None:
            changes["texts"] = tuple(texts)
            if self.episodes is not None and "episodes" not in values and len(texts) != len(self.episodes):
                raise ValueError(f"{len(texts)} texts for {len(self.episodes)} episodes: give their episodes too")
        changes.update(values)
        return replace(self, **changes)

    # ------------------------------------------------------------ views
    @property
    def sampled_mask(self) -> Tensor:
        """1 for the response tokens the model sampled: what losses, advantages and KL cover."""
        return self.response_mask if self.action_mask is None else self.action_mask

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[1])

    @property
    def input_ids(self) -> Tensor:
        import torch

        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        import torch

        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(-1).long()

    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    # ------------------------------------------------------------ copies
    def to(self, device: torch.device | str) -> Sequences:
        move = lambda t, _=None: t.to(device)  # noqa: E731
        return self.replaced(prompt=move, response=move, row=move)

    def select(self, idx: Tensor | slice) -> Sequences:
        """The rows ``idx`` names: a slice, row numbers, or a bool mask over the rows."""
        if isinstance(idx, slice):
            rows = list(range(len(self))[idx])
        else:
            rows = idx.nonzero().flatten().tolist() if idx.dtype == _bool_dtype() else idx.tolist()
        take = lambda t, _=None: t[idx]  # noqa: E731
        episodes = None if self.episodes is None else tuple(self.episodes[i] for i in rows)
        return self.replaced(
            prompt=take, response=take, row=take, texts=[self.texts[i] for i in rows], episodes=episodes
        )

    def reward_texts(self) -> list[str]:
        """The responses as reward functions receive them: texts, or `EpisodeText`s with their turns."""
        if self.episodes is None:
            return list(self.texts)
        return [EpisodeText(t, turns) for t, turns in zip(self.texts, self.episodes)]

    def trimmed(self) -> Sequences:
        """Without the padding columns no row uses (left prompt padding, right response padding)."""
        keep_r, keep_p = self.used_widths()
        if keep_r == self.response_ids.shape[1] and keep_p == self.prompt_len:
            return self
        return self.replaced(prompt=lambda t, _: t[:, self.prompt_len - keep_p :], response=lambda t, _: t[:, :keep_r])

    def used_widths(self) -> tuple[int, int]:
        """(response columns, prompt columns) the longest row uses."""
        if not len(self):
            return 0, 0
        return int(self.response_lengths.max()), int(self.prompt_mask.sum(-1).max())

    @classmethod
    def concat(cls, parts: Sequence[Sequences], pad_id: int, index_offsets: Sequence[int]) -> Sequences:
        """Several as one: prompts re-padded on the left, responses on the right; ``prompt_index``
        shifted by each part's first prompt; a response column only when every part has it."""
        import torch

        p_width = max(s.prompt_len for s in parts)
        r_width = max(s.response_ids.shape[1] for s in parts)

        def join(name: str, fill: float | None, width: int, left: bool) -> Tensor | None:
            values = [getattr(s, name) for s in parts]
            if any(v is None for v in values):
                return None
            return torch.cat([_pad(v, width, pad_id if fill is None else fill, left) for v in values])

        first = parts[0]
        episodes = None
        if any(s.episodes is not None for s in parts):  # a part of single-turn rows: no turns of their own
            episodes = tuple(e for s in parts for e in (s.episodes or ((),) * len(s)))
        return first.replaced(
            texts=[t for s in parts for t in s.texts],
            episodes=episodes,
            version=min(s.version for s in parts),
            prompt_index=torch.cat([s.prompt_index + off for s, off in zip(parts, index_offsets)]),
            **{n: join(n, f, p_width, True) for n, f in PROMPT_FIELDS.items()},
            **{n: join(n, f, r_width, False) for n, f in RESPONSE_FIELDS.items()},
        )


def _bool_dtype() -> Any:
    import torch

    return torch.bool


def _pad(t: Tensor, width: int, fill: float, left: bool = False) -> Tensor:
    """``t`` [B, W, ...] padded with ``fill`` to [B, width, ...] on the right (or the left)."""
    import torch

    if t.shape[1] == width:
        return t
    out = torch.full((t.shape[0], width, *t.shape[2:]), fill, dtype=t.dtype)
    if left:
        out[:, width - t.shape[1] :] = t
    else:
        out[:, : t.shape[1]] = t
    return out


@dataclass(frozen=True)
class Rollout:
    """Responses of one generate call: sequences, behaviour log-probs [B, R] of each sampled
    token, and which rows are finished (EOS, a stop string or the response budget); the others may resume."""

    sequences: Sequences
    logprobs: Tensor
    finished: Tensor  # [B] bool
    greedy: bool = False  # how it was sampled; resuming samples the same way

    def select(self, idx: Tensor | slice) -> Rollout:
        return Rollout(
            sequences=self.sequences.select(idx),
            logprobs=self.logprobs[idx],
            finished=self.finished[idx],
            greedy=self.greedy,
        )

    @classmethod
    def concat(cls, parts: Sequence[Rollout], pad_id: int, index_offsets: Sequence[int]) -> Rollout:
        import torch

        if len(parts) == 1 and index_offsets[0] == 0:
            return parts[0]
        width = max(p.logprobs.shape[1] for p in parts)
        return Rollout(
            sequences=Sequences.concat([p.sequences for p in parts], pad_id, index_offsets),
            logprobs=torch.cat([_pad(p.logprobs, width, 0.0) for p in parts]),
            finished=torch.cat([p.finished for p in parts]),
            greedy=parts[0].greedy,
        )


@dataclass(frozen=True)
class Part:
    """A streamed part of a step's responses: finished groups (their rows carry behaviour
    log-probs in ``sequences.logprobs``) and the prompts they answer."""

    sequences: Sequences
    prompts: list[Prompt]


@dataclass(frozen=True)
class GenerateResult:
    """One generate task's result for one step.

    ``prompts``: the batch's prompts when generation chose them (partial rollouts), else None
    (the step's own). ``parts``: the responses as streamed parts. ``outputs`` and ``nodes``
    (dynamic sampling): what the nodes between the generate node and its filter wrote, and each
    such node's (seconds, metrics)."""

    prompts: list[Prompt] | None
    sequences: Sequences
    metrics: dict[str, Any]
    parts: list[Part]
    outputs: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepBatch(Mapping[str, Any]):
    """The values one train step reads, by key (a read-only mapping: losses index it), and the
    weight version the proximal log-probs were computed with (``policy_version``): tokens a
    sample holds of that version are on-policy."""

    columns: Mapping[str, Any]
    policy_version: int = 0

    def __getitem__(self, key: str) -> Any:
        if key == "policy_version" and key not in self.columns:  # how losses written before StepBatch read it
            return self.policy_version
        return self.columns[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)

    def with_columns(self, columns: Mapping[str, Any]) -> StepBatch:
        return replace(self, columns=dict(columns))


def sequences_in(batch: dict[str, Any], who: str) -> Sequences:
    """The one Sequences value in ``batch``; ``who`` (e.g. "node 'gae'", "loss 'ppo'") names the reader."""
    found = [v for v in batch.values() if isinstance(v, Sequences)]
    if len(found) != 1:
        from flowrl.errors import GraphError

        raise GraphError(
            f"{who} must read exactly one key holding generated responses (found {len(found)}); add "
            "e.g. 'responses' to its reads."
        )
    return found[0]


def pair_rows(seqs: Sequences, who: str) -> tuple[Tensor, Tensor]:
    """The chosen and the rejected rows of preference pairs (a ``g.source(..., rows="pairs")`` node's:
    row ``2i`` chosen, ``2i+1`` rejected, one prompt each), as two index tensors; ``who`` (e.g. "loss
    'dpo'") names the reader when the rows are not such pairs."""
    import torch

    from flowrl.errors import GraphError

    n = len(seqs)
    index = seqs.prompt_index
    if n % 2 or (n and not bool((index[0::2] == index[1::2]).all())):
        raise GraphError(
            f"{who} reads preference pairs (row 2i chosen, row 2i+1 rejected, of one prompt), and its {n} rows are "
            "not such pairs: train it on the responses of a source node with rows='pairs' "
            "(g.source('data', reads='prompts', writes='responses', rows='pairs')), registered with rows='pairs'."
        )
    return torch.arange(0, n, 2), torch.arange(1, n, 2)
