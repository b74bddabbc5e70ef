"""Multi-turn rollouts: the model acts, an environment answers, for up to T model turns.

Each response is one episode with an environment episode of its own (`flowrl.tasks.environments`:
``env.episode(prompt).step(turn)``). The model's turn ends at EOS (or a stop string) or at the
node's ``turn_tokens``; the environment then answers with a `Step`: text, or tool results the chat
template renders (`flowrl.tasks.tools`), a turn reward, and whether the episode is done. What it
writes goes into the response and the engine resumes from everything so far
(`GenerationEngine.resume`), until the environment ends the episode, the node's ``turns`` are
used, or a budget is spent: ``turn_tokens`` per model turn, ``env_tokens`` of environment text per
episode (None: environment text shares the response budget), the response budget as a whole.

The environment's tokens are part of what the model reads (``response_mask``) but not of what it
is trained on (``action_mask``: losses, advantages, KL and the log-prob check cover only sampled
tokens). Every row keeps its turns (`Turn`s: `Sequences.episodes`); reward functions receive them
on each response (`EpisodeText.turns`).

`Episodes.advance` is the one step of the state machine, called after every engine call on the
rows it sampled: whole-turn calls in ``sync``/``one_step_off`` (`Episodes.run`), decode chunks
under partial, async and streaming rollouts (`flowrl.runtime.rollout.StepRollout`), where a row's
episode carries across steps with the row. A row restored from a checkpoint gets a fresh
environment episode replayed through its recorded model turns; one whose replay answers
differently restarts from its prompt.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import torch

from flowrl.contract.data import Prompt, Sequences, Turn
from flowrl.errors import FlowRLError, GraphError, reworded
from flowrl.runtime.batch import pad_id
from flowrl.runtime.rewardpool import run_coroutine
from flowrl.tasks.environments import ReplyEpisode, Step


def _tokenizer_template(tokenizer: Any) -> str | None:
    """The tokenizer's own chat template (named so in a render's errors), or None."""
    from flowrl.tasks import bounded
    from flowrl.tasks.tools import resolve_template

    template = resolve_template(tokenizer)
    if template is not None and bounded.template_name(template) == "the chat template":
        bounded.name_template(template, "the model tokenizer's chat template")
    return template


@dataclass
class _Live:
    """The environment episode of one row, and how many of the row's turns it has seen (a row
    restarted, or restored from a checkpoint, no longer matches it)."""

    row: Any
    episode: Any
    seen: int = 0


#: tool-rendered prompts kept at most (prompts come and go with the steps)
_PROMPT_CACHE = 4096


@dataclass
class Episodes:
    """Runs a generate node's episodes with its environment."""

    node: str
    env_name: str
    env: Any
    turns: int  # model turns per episode, at most
    tokenizer: Any
    budget: int  # response tokens of a whole episode (the engine's)
    turn_tokens: int  # model tokens per turn, at most
    env_tokens: int | None = None  # environment text per episode, at most (None: within the budget)
    template: str | None = None  # the chat template tool results are rendered with
    concurrency: int = 64  # environment steps awaited at once (async environments)
    live: dict[int, _Live] = field(default_factory=dict)  # a row's episode number -> its environment episode
    serial: Any = field(default_factory=itertools.count)
    counts: dict[str, float] = field(default_factory=dict)  # since the last `take_metrics`
    _prompts: dict[int, tuple[Prompt, Prompt]] = field(default_factory=dict)  # id -> (prompt, with the tools)

    @classmethod
    def build(
        cls,
        node: Any,
        factory: Callable[..., Any],
        task: Any,
        options: dict[str, Any],
        tokenizer: Any,
        budget: int,
        concurrency: int = 64,
    ) -> Episodes:
        try:
            env = factory(task, **options)
        except FlowRLError:
            raise
        except Exception as exc:
            raise GraphError(f"node '{node.name}': environment '{node.env}' failed to start: {exc}") from exc
        if not callable(getattr(env, "episode", None)) and not callable(getattr(env, "reply", None)):
            raise GraphError(
                f"node '{node.name}': environment '{node.env}' returned {type(env).__name__}, which has neither an "
                "episode(prompt) method (whose result has step(turn)) nor reply(prompt, turns)."
            )
        turn_tokens = node.turn_tokens or max(budget // node.turns, 1)
        template = getattr(task, "template", None) or _tokenizer_template(tokenizer)
        return cls(
            node.name, node.env, env, node.turns, tokenizer, budget, turn_tokens, node.env_tokens, template, concurrency
        )

    # ------------------------------------------------------------ prompts
    @property
    def tools(self) -> list[dict[str, Any]]:
        return list(getattr(self.env, "tools", None) or [])

    def prompt(self, prompt: Prompt) -> Prompt:
        """What the engine is given for ``prompt``: rendered again with the environment's tools."""
        if not self.tools:
            return prompt
        from flowrl.tasks.tools import with_tools

        key = id(prompt)
        if key not in self._prompts or self._prompts[key][0] is not prompt:
            if len(self._prompts) >= _PROMPT_CACHE:
                self._prompts.clear()
            self._prompts[key] = (prompt, with_tools(prompt, self.tools, self.tokenizer, self.template))
        return self._prompts[key][1]

    # ------------------------------------------------------------ the state machine
    def advance(self, rows: Sequence[Any], prompts: Callable[[Any], Prompt], version: int) -> None:
        """After an engine call on ``rows`` (`flowrl.runtime.rollout.Row`s of this node): each row
        whose model turn ended gets its environment's step; a row that goes on is unfinished again.
        ``prompts(row)``: the prompt a row answers."""
        ended = []
        for row in rows:
            live = self.live.get(row.episode)
            if live is None or live.row is not row or live.seen != len(row.turns):
                self._open(row, prompts(row))
            if row.ended:
                continue
            turn = len(row.tokens) - row.turn_start
            if turn > self.turn_tokens:  # a decode chunk ran past the turn's limit: cut at it
                cut = row.turn_start + self.turn_tokens
                row.cut(cut)
                self.counts["cut_tokens"] = self.counts.get("cut_tokens", 0) + turn - self.turn_tokens
                turn = self.turn_tokens
            if not (row.finished or turn >= self.turn_tokens):
                continue  # mid-turn
            if turn == 0:  # no room for another model turn (the context's end)
                self._end(row)
                continue
            ended.append(row)
        if not ended:
            return
        turns = [self._turn(row) for row in ended]
        start = time.perf_counter()
        steps = self._steps([self.live[row.episode].episode for row in ended], turns)
        self.counts["env_s"] = self.counts.get("env_s", 0.0) + time.perf_counter() - start
        eos = getattr(self.tokenizer, "eos_token_id", None)
        for row, turn, step in zip(ended, turns, steps):
            self._apply(row, turn, step, version, row.tokens[-1] == eos)

    def _open(self, row: Any, prompt: Prompt) -> None:
        """A fresh environment episode for ``row``; one with recorded turns (restored from a checkpoint)
        is replayed through them, and restarts from its prompt if the environment answers differently."""
        old = self.live.get(row.episode)
        if old is not None and old.row is row:  # the row restarted: its episode is over
            del self.live[row.episode]
        row.episode = next(self.serial)
        live = self.live[row.episode] = _Live(row, self._episode(prompt))
        recorded, at = list(row.turns), 0
        eos = getattr(self.tokenizer, "eos_token_id", None)
        for i, turn in enumerate(recorded):
            at += turn.tokens
            if turn.role != "assistant":
                continue
            step = self._steps([live.episode], [turn])[0]
            following = recorded[i + 1] if i + 1 < len(recorded) else None
            ended_at_eos = turn.tokens > 0 and row.tokens[at - 1] == eos
            if following is not None and self._written(step, ended_at_eos) != following.text:
                row.restart(row.started)
                live.episode = self._episode(prompt)
                self.counts["replay_restarts"] = self.counts.get("replay_restarts", 0) + 1
                break
        live.seen = len(row.turns)

    def _episode(self, prompt: Prompt) -> Any:
        try:
            if callable(getattr(self.env, "episode", None)):
                return self.env.episode(prompt)
            return ReplyEpisode(self.env, prompt)
        except FlowRLError:
            raise
        except Exception as exc:
            raise self._error("episode()", exc) from exc

    def _error(self, where: str, exc: BaseException) -> GraphError:
        return GraphError(
            f"node '{self.node}': environment '{self.env_name}' raised {type(exc).__name__} in {where}: {exc}"
        )

    def _turn(self, row: Any) -> Turn:
        """The model turn ``row`` just ended, with the tool calls parsed from it."""
        tokens = row.tokens[row.turn_start :]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        calls: tuple[Any, ...] = ()
        if self.tools:
            from flowrl.tasks.tools import parse_tool_calls

            calls, bad = parse_tool_calls(text)
            self.counts["tool_calls"] = self.counts.get("tool_calls", 0) + len(calls)
            self.counts["bad_tool_calls"] = self.counts.get("bad_tool_calls", 0) + bad
        return Turn(role="assistant", text=text, tool_calls=calls, tokens=len(tokens))

    def _steps(self, episodes: Sequence[Any], turns: Sequence[Turn]) -> list[Step]:
        """Each episode's step for its turn; async steps awaited together, ``concurrency`` at once."""
        out: list[Any] = []
        for episode, turn in zip(episodes, turns):
            try:
                out.append(episode.step(turn))
            except FlowRLError:
                raise
            except Exception as exc:
                raise self._error("step()", exc) from exc
        if any(inspect.isawaitable(s) for s in out):
            pending = out
            out = run_coroutine(lambda: self._gather(pending))
        return [self._checked(s) for s in out]

    def _checked(self, step: Any) -> Step:
        """``step`` with its fields' types checked (a Struct built in Python is not)."""
        if not isinstance(step, Step):
            raise GraphError(
                f"node '{self.node}': environment '{self.env_name}' step() returned {type(step).__name__}; it "
                "returns a flowrl.tasks.environments.Step (text or tool_results, reward, done)."
            )
        try:
            return msgspec.convert(msgspec.structs.asdict(step), Step)
        except msgspec.ValidationError as exc:
            raise GraphError(
                f"node '{self.node}': environment '{self.env_name}' step() returned a Step with a bad field: {exc} "
                "(text: str or None; tool_results: a tuple of str, one per call; reward: a number; done: a bool)."
            ) from None

    async def _gather(self, pending: list[Any]) -> list[Any]:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(x: Any) -> Any:
            if not inspect.isawaitable(x):
                return x
            async with gate:
                try:
                    return await x
                except FlowRLError:
                    raise
                except Exception as exc:
                    raise self._error("step()", exc) from exc

        return list(await asyncio.gather(*(one(x) for x in pending)))

    def _written(self, step: Step, ended_at_eos: bool) -> str:
        """The text ``step`` writes into the response after a model turn (that ended at EOS or not)."""
        if step.tool_results:
            from flowrl.tasks.tools import tool_text

            if not self.template:
                raise GraphError(
                    f"node '{self.node}': environment '{self.env_name}' returned tool results, which the chat template "
                    "renders, but the prompts have none (data.chat_template)."
                )
            try:  # rendered within flowrl.tasks.bounded's time and size limits
                return tool_text(self.tokenizer, self.template, step.tool_results, ended_at_eos)
            except FlowRLError as exc:
                raise reworded(exc, f"node '{self.node}': environment '{self.env_name}': {exc}") from None
        return step.text or ""

    def _apply(self, row: Any, turn: Turn, step: Step, version: int, ended_at_eos: bool) -> None:
        """Record ``turn`` and the environment's answer; write it and go on, or end the episode."""
        text = self._written(step, ended_at_eos)
        obs = self._encode(text) if text else []
        row.turns.append(turn)
        model_turns = sum(t.role == "assistant" for t in row.turns)
        env_used = sum(t.tokens for t in row.turns if t.role != "assistant")
        out_of_room = row.finished and len(row.tokens) >= self.budget  # the response budget is spent
        more = not step.done and not out_of_room and model_turns < self.turns
        room = len(row.tokens) + len(obs) < self.budget or (step.done and len(row.tokens) + len(obs) <= self.budget)
        fits = room and (self.env_tokens is None or env_used + len(obs) <= self.env_tokens)
        wanted = bool(obs) and (more or step.done)  # text no model turn or final reply follows is not written
        write = wanted and fits
        if wanted and not fits:
            self.counts["env_truncated"] = self.counts.get("env_truncated", 0) + 1
            more = False
        role = "tool" if step.tool_results else "env"
        row.turns.append(
            Turn(role=role, text=text if write else "", reward=float(step.reward), tokens=len(obs) * write)
        )
        if write:
            row.write(obs, version)
            self.counts["env_replies"] = self.counts.get("env_replies", 0) + 1
        if more:  # the model's next turn (after what the environment wrote, if anything)
            row.text = "".join(t.text for t in row.turns)
            row.finished, row.turn_start = False, len(row.tokens)
            self.live[row.episode].seen = len(row.turns)
        else:
            self._end(row)

    def _end(self, row: Any) -> None:
        """The episode of ``row`` is over: its text is its turns', and its environment episode goes."""
        row.text = "".join(t.text for t in row.turns)
        row.finished = row.ended = True
        self.live.pop(row.episode, None)

    def _encode(self, text: str) -> list[int]:
        """Environment text's tokens; text the tokenizer cannot represent (unknown tokens) is refused:
        the model would read something other than what the rewards score."""
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is not None and unk in tokens:
            raise GraphError(
                f"node '{self.node}': environment '{self.env_name}' replied {text!r}, which the model's tokenizer "
                f"cannot encode (it would read {self.tokenizer.decode(tokens)!r}); reply in the tokenizer's vocabulary."
            )
        return tokens

    # ------------------------------------------------------------ one whole-turn rollout (sync modes)
    def run(
        self, gen: Any, prompts: Sequence[Prompt], n: int, rng: torch.Generator, version: int = 0, greedy: bool = False
    ) -> Sequences:
        """``n`` episodes per prompt (rows grouped by prompt), a whole model turn per engine call, as
        Sequences with behaviour log-probs, the action mask and each row's turns."""
        from flowrl.runtime.rollout import absorb, fresh_rows, rows_to_rollout

        first = gen.generate(
            [self.prompt(p) for p in prompts], n=n, greedy=greedy, generator=rng, max_new_tokens=self.turn_tokens
        )
        rows = fresh_rows(list(range(len(prompts))), first, n, version, 0, multi=True)
        of = lambda row: prompts[row.group]  # noqa: E731
        self.advance(rows, of, version)
        while active := [r for r in rows if not r.finished]:
            out = gen.resume(
                rows_to_rollout(active, pad_id(self.tokenizer), greedy), generator=rng, max_new_tokens=self.turn_tokens
            )
            absorb(active, out, version)
            self.advance(active, of, version)
        seqs = rows_to_rollout(rows, pad_id(self.tokenizer), greedy, episodes=True).sequences
        return replace(seqs, prompt_index=torch.tensor([r.group for r in rows], dtype=torch.long))

    def take_metrics(self, seqs: Sequences) -> dict[str, float]:
        """The episodes' metrics over ``seqs`` (a step's rows) and the counts since the last call."""
        episodes = seqs.episodes or ()
        n = max(len(episodes), 1)
        out = {
            "turns": round(sum(sum(t.role == "assistant" for t in e) for e in episodes) / n, 4),
            "env_replies": round(sum(sum(t.role != "assistant" and t.tokens > 0 for t in e) for e in episodes) / n, 4),
            "env_reward": round(sum(sum(t.reward for t in e) for e in episodes) / n, 4),
            "env_tokens": round(sum(sum(t.tokens for t in e if t.role != "assistant") for e in episodes) / n, 4),
        }
        for key in ("tool_calls", "bad_tool_calls", "env_truncated", "cut_tokens", "replay_restarts"):
            out[key] = int(self.counts.get(key, 0))
        out["env_s"] = round(self.counts.get("env_s", 0.0), 4)
        self.counts = {}
        return out
