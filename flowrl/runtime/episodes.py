"""Multi-turn rollouts: the model acts, an environment answers, for up to T model turns.

Each response is one episode: the model's first turn is sampled from the prompt; then the
environment's reply (``reply(prompt, turns)``) is written into the response and the engine
resumes from everything so far (`GenerationEngine.resume`), until the environment ends the
episode, the node's ``turns`` are used or the response budget is full. The environment's tokens
are part of what the model reads (``response_mask``) but not of what it is trained on
(``action_mask``: losses, advantages, KL and the log-prob check cover only sampled tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.data import Prompt, Rollout, Sequences
from flowrl.errors import FlowRLError, GraphError
from flowrl.runtime.batch import padded_rows, ragged


@dataclass
class _Episode:
    prompt: Prompt
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action: list[float] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)  # the model's turns, as text
    text: str = ""  # the whole episode: turns and replies
    done: bool = False

    def add(self, tokens: list[int], logprobs: list[float], sampled: bool, text: str) -> None:
        self.tokens += tokens
        self.logprobs += logprobs if sampled else [0.0] * len(tokens)
        self.action += [1.0 if sampled else 0.0] * len(tokens)
        self.text += text
        if sampled:
            self.turns.append(text)


@dataclass
class Episodes:
    """Runs a generate node's episodes with its environment."""

    node: str
    env_name: str
    env: Any
    turns: int
    tokenizer: Any
    budget: int  # response tokens of a whole episode
    metrics: dict[str, float] = field(default_factory=dict)  # of the last call

    @classmethod
    def build(
        cls, node: Any, factory: Callable[..., Any], task: Any, options: dict[str, Any], tokenizer: Any, budget: int
    ) -> Episodes:
        try:
            env = factory(task, **options)
        except FlowRLError:
            raise
        except Exception as exc:
            raise GraphError(f"node '{node.name}': environment '{node.env}' failed to start: {exc}") from exc
        if not callable(getattr(env, "reply", None)):
            raise GraphError(
                f"node '{node.name}': environment '{node.env}' returned {type(env).__name__}, which has no "
                "reply(prompt, turns) method."
            )
        return cls(node.name, node.env, env, node.turns, tokenizer, budget)

    def _reply(self, episode: _Episode) -> str | None:
        try:
            reply = self.env.reply(episode.prompt, list(episode.turns))
        except FlowRLError:
            raise
        except Exception as exc:
            raise GraphError(
                f"node '{self.node}': environment '{self.env_name}' raised {type(exc).__name__} in reply(): {exc}"
            ) from exc
        if reply is not None and not isinstance(reply, str):
            raise GraphError(
                f"node '{self.node}': environment '{self.env_name}' replied {type(reply).__name__}; a reply is text "
                "(or None to end the episode)."
            )
        return reply

    def _encode(self, reply: str) -> list[int]:
        """A reply's tokens; one the tokenizer cannot represent (unknown tokens) is refused: the model
        would read something other than what the rewards score."""
        tokens = self.tokenizer.encode(reply, add_special_tokens=False)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is not None and unk in tokens:
            raise GraphError(
                f"node '{self.node}': environment '{self.env_name}' replied {reply!r}, which the model's tokenizer "
                f"cannot encode (it would read {self.tokenizer.decode(tokens)!r}); reply in the tokenizer's vocabulary."
            )
        return tokens

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def run(self, gen: Any, prompts: Sequence[Prompt], n: int, rng: torch.Generator) -> Sequences:
        """``n`` episodes per prompt (rows grouped by prompt) as Sequences with behaviour log-probs
        and the action mask."""
        turn = max(self.budget // self.turns, 1)  # tokens of one model turn: room for the turns after it
        first = gen.generate(prompts, n=n, greedy=False, generator=rng, max_new_tokens=turn)
        seqs = first.sequences
        lengths = seqs.response_mask.sum(-1).long().tolist()
        episodes = []
        for i in range(len(seqs)):
            ids = seqs.prompt_ids[i][seqs.prompt_mask[i].bool()].tolist()
            ep = _Episode(prompts[int(seqs.prompt_index[i])], ids)
            tokens = seqs.response_ids[i, : lengths[i]].tolist()
            ep.add(tokens, first.logprobs[i, : lengths[i]].tolist(), True, self._text(tokens))
            episodes.append(ep)
        replies = 0
        for _ in range(self.turns - 1):
            active = []
            for ep in episodes:
                if ep.done:
                    continue
                reply = self._reply(ep)
                obs = [] if reply is None else self._encode(reply)
                if reply is None or len(ep.tokens) + len(obs) >= self.budget:
                    ep.done = True
                    continue
                ep.add(obs, [], False, reply)
                replies += 1
                active.append(ep)
            if not active:
                break
            out = gen.resume(self._rollout(active), generator=rng, max_new_tokens=turn)
            new = out.sequences.response_mask.sum(-1).long().tolist()
            for j, ep in enumerate(active):
                have = len(ep.tokens)
                tokens = out.sequences.response_ids[j, have : new[j]].tolist()
                if not tokens:
                    ep.done = True
                    continue
                ep.add(tokens, out.logprobs[j, have : new[j]].tolist(), True, self._text(tokens))
        self.metrics = {
            "turns": round(sum(len(ep.turns) for ep in episodes) / max(len(episodes), 1), 4),
            "env_replies": round(replies / max(len(episodes), 1), 4),
        }
        return self._sequences(episodes, seqs.prompt_index)

    def _pad(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    def _rollout(self, episodes: list[_Episode]) -> Rollout:
        seqs = self._sequences(episodes, torch.arange(len(episodes)))
        assert seqs.logprobs is not None
        return Rollout(sequences=seqs, logprobs=seqs.logprobs, finished=torch.zeros(len(episodes), dtype=torch.bool))

    def _sequences(self, episodes: list[_Episode], prompt_index: torch.Tensor) -> Sequences:
        prompt_ids, prompt_mask, response_ids, response_mask = padded_rows(
            [e.prompt_ids for e in episodes], [e.tokens for e in episodes], self._pad()
        )
        width = response_ids.shape[1]
        return Sequences(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            prompt_index=prompt_index,
            texts=tuple(e.text for e in episodes),
            logprobs=ragged([e.logprobs for e in episodes], width, 0.0, torch.float32),
            action_mask=ragged([e.action for e in episodes], width, 0.0, torch.float32),
        )
