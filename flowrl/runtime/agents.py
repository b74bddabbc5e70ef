"""Agent rollouts: the user's agent plays each episode over the OpenAI API; every token is recorded.

A generate node with ``agent=`` runs the agent (`flowrl.agents`) ``n`` times per prompt, at most
``concurrency`` episodes at once, each with its own base URL of the run's endpoint
(`flowrl.runtime.endpoint`). The driver thread (the one running the rollout) serves the requests
with the run's generation engine, batched: every decode call continues all requests in flight
(``resume`` over rows whose context is the episode so far), so requests that arrive while a call
runs join the next one.

**Token in, token out.** An episode is one trajectory, one training row: its prompt is the first
request's messages as the chat template renders them (with the request's tools), then for each
request the tokens the engine sampled (trained on: action mask 1, with their behaviour log-probs
and the weight version of each token) and, before the next one, what the agent appended (tool
results, user turns: the template's text after the assistant turn, tokenised on its own and masked
out of the loss). The sampled tokens are never re-tokenised: a request whose history extends the
episode (the earlier messages and the reply it got) continues the recorded tokens; one whose
history does not (the agent rewrote it) starts the trajectory again (``forks``), and training sees
the last one. ``/v1/completions`` continues exactly when its prompt holds the episode's token ids
(or its text so far).

**Bounded.** A request is refused with an OpenAI error (never a crash of the run) when it is
malformed or too large (the endpoint), names an episode that is over, arrives while the episode
has one in flight, passes the node's ``turns``, the response budget or the model's context; a
refused request leaves its episode as it was. An agent that raises,
returns something other than a reward, or passes ``timeout`` seconds of its own time (time spent
waiting on the endpoint does not count) scores ``failure_reward``; its process is killed (a
command) or its coroutine cancelled, a thread is left behind.

**Rollout modes.** ``sync``/``one_step_off`` (`AgentRollouts.run`): the step's episodes whole.
Chunked (partial, async, streaming: `flowrl.runtime.rollout.StepRollout`): a decode chunk per
yield, weights may change between chunks, each token keeps its version; at a step's start an
in-flight request whose tokens passed the staleness bound is aborted and sampled again from its
start with the new weights, and an episode whose earlier turns did is played again from its prompt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from flowrl import agents as agent_api
from flowrl.contract.data import Prompt, Sequences, ToolCall, Turn
from flowrl.errors import FlowRLError, GraphError
from flowrl.runtime.batch import pad_id
from flowrl.runtime.endpoint import ApiError, Call, ChatRequest, Endpoint, stops

log = logging.getLogger("flowrl.agents")

#: a chat template for tokenizers without one (the tiny models' character tokenizer): ``role:content|``
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_MARK = "\x00flowrl-turn\x00"
#: how long the driver waits for an agent's next request before the others decode without it
SETTLE_S = 1.0


@dataclass
class _Request:
    """A request in flight: its call, the rows it samples (one per choice) and where its turn began."""

    call: Call
    rows: list[Any]
    start: int  # the trajectory's length when the request began (its new tokens follow)
    limit: int  # new tokens it may sample
    stop: tuple[str, ...]
    reasons: list[str] = field(default_factory=list)


@dataclass
class _Episode:
    id: str
    row: Any  # its trajectory: a `flowrl.runtime.rollout.Row` (the buffer's, under chunked rollouts)
    prompt: Prompt
    state: str = "waiting"  # waiting | running | over
    started: float = 0.0
    waited: float = 0.0  # seconds its requests spent in the endpoint (not the agent's own time)
    request: _Request | None = None
    history: list[tuple] | None = None  # the normalised messages of its last request (chat)
    replies: list[tuple] = field(default_factory=list)  # the normalised reply of each choice
    choices: list[Any] = field(default_factory=list)  # each choice's row (the first is the trajectory)
    context: str | None = None  # completions: the text so far (last prompt + its completion)
    handle: Any = None  # the agent's future (async) or thread
    requests: int = 0


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True)


def _norm(m: Mapping[str, Any]) -> tuple:
    """A message as compared between requests: role, text, tool calls (name, arguments)."""
    calls = tuple(
        (str((c.get("function") or {}).get("name")), _arguments((c.get("function") or {}).get("arguments", {})))
        for c in (m.get("tool_calls") or ())
        if isinstance(c, Mapping)
    )
    return (m.get("role"), _text(m.get("content")).strip(), calls)


def _plain(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the chat template receives it: text content (parts joined), its other fields kept."""
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = _text(m.get("content"))
    return out


@dataclass
class AgentRollouts:
    """The episodes of one generate node's agent, and the endpoint their requests reach."""

    node: str
    model: str
    agent: Callable[..., Any]
    agent_name: str
    options: dict[str, Any]
    tokenizer: Any
    template: str
    budget: int  # response tokens of a whole episode
    turns: int  # requests per episode, at most
    turn_tokens: int  # new tokens per request, at most
    timeout: float
    concurrency: int
    failure_reward: float
    greedy: bool = False
    context: int | None = None  # the model's context (prompt and response); None: the engine's, when it says
    episodes: dict[str, _Episode] = field(default_factory=dict)
    events: queue.Queue = field(default_factory=queue.Queue)
    counts: dict[str, float] = field(default_factory=dict)
    endpoint: Endpoint | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _loop_thread: threading.Thread | None = None
    _serial: int = 0
    _warned: set[str] = field(default_factory=set)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.endpoint is None:
            self.endpoint = Endpoint(lambda call: self.events.put(("call", call)), self.model)
            self.endpoint.start()

    def close(self) -> None:
        for ep in list(self.episodes.values()):
            if ep.state != "over":
                self._stop(ep, ApiError(410, "the run is over.", "episode_over"))
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=10)  # the loop stops at its next turn (a cancelled agent's, too)
            self._loop_thread = None

    # ------------------------------------------------------------ episodes
    def launch(self, groups: Sequence[int], prompts: Sequence[Prompt], n: int, step: int) -> list[Any]:
        """``n`` episodes for each prompt (group numbers ``groups``): their rows, unfinished, in order."""
        from flowrl.runtime.rollout import Row

        self.start()
        rows = []
        for group, prompt in zip(groups, prompts):
            for _ in range(n):
                row = Row(group=group, prompt_ids=[], started=step, multi=True)
                self._open(row, prompt)
                rows.append(row)
        return rows

    def _open(self, row: Any, prompt: Prompt) -> _Episode:
        self._serial += 1
        ep = _Episode(id=f"{self.node}-{self._serial}-{secrets.token_hex(3)}", row=row, prompt=prompt)
        row.episode = self._serial
        self.episodes[ep.id] = ep
        return ep

    def _running(self) -> list[_Episode]:
        return [e for e in self.episodes.values() if e.state == "running"]

    def _start_waiting(self) -> None:
        free = self.concurrency - len(self._running())
        for ep in [e for e in self.episodes.values() if e.state == "waiting"][: max(free, 0)]:
            self._start(ep)

    def _start(self, ep: _Episode) -> None:
        assert self.endpoint is not None
        prompt = ep.prompt
        messages = self._messages(prompt)
        given = {
            "base_url": self.endpoint.base_url(ep.id),
            "api_key": self.endpoint.key,
            "model": self.model,
            "episode_id": ep.id,
            "messages": messages,
            "prompt": prompt.text,
            "answer": prompt.answer,
            "meta": dict(prompt.meta),
            **self.options,
        }
        kwargs = agent_api.arguments(self.agent, given)
        ep.state, ep.started = "running", time.monotonic()
        done = lambda value, error: self.events.put(("end", ep.id, value, error))  # noqa: E731
        if agent_api.is_async(self.agent):
            loop = self._agent_loop()

            async def play() -> None:
                try:
                    value = await self.agent(**kwargs)
                except asyncio.CancelledError:
                    return
                except BaseException as exc:  # noqa: BLE001 - the agent's failure is its episode's
                    done(None, exc)
                    return
                done(value, None)

            ep.handle = asyncio.run_coroutine_threadsafe(play(), loop)
            return

        def play_sync() -> None:
            try:
                value = self.agent(**kwargs)
            except BaseException as exc:  # noqa: BLE001
                done(None, exc)
                return
            done(value, None)

        ep.handle = threading.Thread(target=play_sync, name=f"flowrl-agent-{ep.id}", daemon=True)
        ep.handle.start()

    def _agent_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=loop.run_forever, name="flowrl-agents", daemon=True)
            self._loop_thread.start()
            self._loop = loop
        return self._loop

    def _count(self, key: str, by: float = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + by

    def _warn(self, ep: _Episode, what: str) -> None:
        message = f"node '{self.node}': agent '{self.agent_name}' {what}"
        if message not in self._warned and len(self._warned) < 20:
            self._warned.add(message)
            log.warning("%s (episode %s; it scores failure_reward %s)", message, ep.id, self.failure_reward)

    def _stop(self, ep: _Episode, error: ApiError) -> None:
        """End ``ep``'s agent: its request in flight gets ``error``, its coroutine or process is cancelled."""
        if ep.request is not None:
            self._drop(ep, error)
        if hasattr(ep.handle, "cancel"):  # a coroutine's future (a thread cannot be stopped)
            ep.handle.cancel()
        ep.state = "over"

    def _drop(self, ep: _Episode, error: ApiError) -> None:
        """Answer ``ep``'s request in flight with ``error``; what it sampled is taken back."""
        req = ep.request
        assert req is not None
        if not req.call.future.done():
            req.call.future.set_exception(error)
        ep.waited += time.monotonic() - req.call.received
        ep.request = None

    def _finish(self, ep: _Episode, reward: float, version: int) -> None:
        """``ep`` is over: its row ends with the reward as its last (empty) turn."""
        row = ep.row
        ep.state = "over"
        if not row.prompt_ids:  # no request reached the endpoint: the task's prompt, one unsampled EOS
            try:
                row.prompt_ids = self._encode(self._render([_plain(m) for m in self._messages(ep.prompt)], None, True))
            except (FlowRLError, ApiError):
                row.prompt_ids = self.tokenizer.encode(ep.prompt.text) or [self.tokenizer.eos_token_id]
            row.tokens, row.logprobs = [self.tokenizer.eos_token_id], [0.0]
            row.versions, row.action = [version], [0.0]
            row.turns = [Turn(role="env", text="", tokens=1)]
        row.turns.append(Turn(role="env", text="", reward=reward, tokens=0))
        row.text = "".join(t.text for t in row.turns)
        row.finished = row.ended = True
        self.episodes.pop(ep.id, None)

    @staticmethod
    def _messages(prompt: Prompt) -> list[dict[str, Any]]:
        return [dict(m) for m in prompt.messages] or [{"role": "user", "content": prompt.text}]

    def _ended(self, ep_id: str, value: Any, error: BaseException | None, version: int) -> None:
        ep = self.episodes.get(ep_id)
        if ep is None or ep.state != "running":
            return
        if ep.request is not None:  # it returned with a request of its own in flight
            self._drop(ep, ApiError(410, "the agent returned; its episode is over.", "episode_over"))
        self._count("episodes")
        if error is not None:
            self._count("agent_errors")
            self._warn(ep, f"raised {type(error).__name__}: {error}")
            self._finish(ep, self.failure_reward, version)
            return
        try:
            reward = agent_api.reward_of(value)
        except TypeError as exc:
            self._count("bad_rewards")
            self._warn(ep, str(exc))
            self._finish(ep, self.failure_reward, version)
            return
        if reward is None:
            self._count("no_reward")
        self._finish(ep, 0.0 if reward is None else reward, version)

    def _own_time(self, ep: _Episode, now: float) -> float:
        inside = now - ep.request.call.received if ep.request is not None else 0.0
        return now - ep.started - ep.waited - inside

    def _deadlines(self, version: int) -> None:
        now = time.monotonic()
        for ep in self._running():
            if self._own_time(ep, now) > self.timeout:
                self._count("episodes")
                self._count("timeouts")
                self._warn(ep, f"ran past its timeout of {self.timeout:g} s")
                self._stop(ep, ApiError(408, "the episode timed out.", "timeout"))
                self._finish(ep, self.failure_reward, version)

    # ------------------------------------------------------------ requests
    def _settle(self, version: int) -> None:
        """Take requests and agent ends until every running episode has a request in flight (or none
        runs): decoding then starts on all of them at once, in the episodes' order, so a run's samples
        do not depend on when requests arrived. Waiting episodes start as slots free. An agent slower than
        `SETTLE_S` to send its next request lets the others decode without it (the timeouts still run)."""
        first_pending: float | None = None
        while True:
            self._start_waiting()
            running = self._running()
            if all(e.request is not None for e in running):
                return
            if any(e.request is not None for e in running):
                first_pending = first_pending or time.monotonic()
                if time.monotonic() - first_pending > SETTLE_S:
                    self._count("unsettled_decodes")
                    return
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                self._deadlines(version)
                continue
            self._event(event, version)
            while True:  # what else arrived meanwhile
                try:
                    self._event(self.events.get_nowait(), version)
                except queue.Empty:
                    break
            self._deadlines(version)

    def _event(self, event: tuple, version: int) -> None:
        if event[0] == "call":
            self._admit(event[1], version)
        else:
            self._ended(event[1], event[2], event[3], version)

    def _admit(self, call: Call, version: int) -> None:
        ep = self.episodes.get(call.episode)
        saved = _state(ep) if ep is not None else None  # a refused request leaves its episode as it was
        counted = dict(self.counts)
        try:
            if ep is None or ep.state != "running":
                raise ApiError(410, f"episode {call.episode!r} is over or unknown to this run.", "episode_over")
            if ep.request is not None:
                raise ApiError(409, "the episode has a request in flight; send one at a time.", "busy")
            if ep.requests >= self.turns:
                raise ApiError(
                    429, f"the episode made its {self.turns} requests (the node's turns).", "turns_exhausted"
                )
            if call.chat:
                self._context_chat(ep, call.request, version)
            else:
                self._context_completion(ep, call.request, version)
            row = ep.row
            room = self.budget - len(row.tokens)
            if room <= 0:
                raise ApiError(
                    400, f"the episode's {self.budget} response tokens are used up.", "context_length_exceeded"
                )
            context = self._context_limit()
            if context is not None and len(row.prompt_ids) + len(row.tokens) >= context:
                raise ApiError(
                    400,
                    f"the request's {len(row.prompt_ids) + len(row.tokens)} tokens fill the model's context of "
                    f"{context} tokens.",
                    "context_length_exceeded",
                )
        except (ApiError, FlowRLError) as exc:
            if ep is not None and saved is not None and ep.state == "running":
                _restore(ep, saved)
                self.counts = counted  # a fork it began is not one
            self._count("refused")
            # its template or text (a FlowRLError): the request's fault, said to the agent
            error = exc if isinstance(exc, ApiError) else ApiError(400, str(exc), "bad_messages")
            call.future.set_exception(error)
            return
        request = call.request
        asked = getattr(request, "max_completion_tokens", None) or request.max_tokens
        limit = min(asked or self.turn_tokens, self.turn_tokens, room)
        if request.temperature not in (None, 1.0) or request.top_p not in (None, 1.0):
            self._count("sampling_ignored")  # the policy samples as the run says (what training corrects for)
        rows = [_copy(row) for _ in range(request.n)]  # what each choice samples (the trajectory takes one)
        for r in rows:
            r.finished = False
            r.turn_start = len(r.tokens)
        ep.request = _Request(call, rows, len(row.tokens), limit, stops(request))
        ep.requests += 1
        self._count("requests")

    def _context_limit(self) -> int | None:
        """The model's context in tokens (prompt and response), where the engine or the tokenizer says it."""
        if self.context is None:
            known = getattr(self.tokenizer, "model_max_length", None)
            if isinstance(known, int) and 0 < known < 1 << 24:
                return known
        return self.context

    def _render(self, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
        from flowrl.tasks import bounded

        where = f"node '{self.node}': the agent's messages"
        return bounded.render_chat(
            self.tokenizer, self.template, messages, where=where, add_generation_prompt=generation, tools=tools
        )

    def _encode(self, text: str) -> list[int]:
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is not None and unk in tokens:
            raise ApiError(400, f"the model's tokenizer cannot encode {text[:80]!r}.", "unencodable")
        return tokens

    def _restart(self, ep: _Episode, prompt_ids: list[int]) -> None:
        row = ep.row
        if row.prompt_ids:
            self._count("forks")
        row.prompt_ids = prompt_ids
        row.tokens, row.logprobs, row.versions, row.action, row.turns = [], [], [], [], []

    def _context_chat(self, ep: _Episode, request: ChatRequest, version: int) -> None:
        """The episode's trajectory made ready for ``request``: continued with what the agent appended
        after the reply it got, or started again from the request's messages."""
        messages = [_plain(m) for m in request.messages]
        normal = [_norm(m) for m in request.messages]
        tools = request.tools or None
        prior = ep.history
        k = len(prior) if prior is not None else -1
        choice = -1
        if prior is not None and len(normal) > k + 1 and normal[:k] == prior:
            choice = next((i for i, r in enumerate(ep.replies) if normal[k] == r), -1)
        if choice < 0:
            self._restart(ep, self._encode(self._render(messages, tools, True)))
        else:
            if choice > 0:  # the agent went on with another choice: its tokens are the trajectory's
                _adopt(ep.row, ep.choices[choice])
            row = ep.row
            ended_at_eos = bool(row.tokens) and row.tokens[-1] == self.tokenizer.eos_token_id
            text = self._continuation(messages[: k + 1], messages[k + 1 :], tools, ended_at_eos)
            if text is None:
                self._count("template_forks")
                self._restart(ep, self._encode(self._render(messages, tools, True)))
            else:
                ids = self._encode(text)
                row.write(ids, version)
                role = "tool" if any(m.get("role") == "tool" for m in messages[k + 1 :]) else "env"
                row.turns.append(Turn(role=role, text=text, tokens=len(ids)))
        ep.history = normal

    def _continuation(
        self, history: list[dict[str, Any]], new: list[dict[str, Any]], tools: Any, ended_at_eos: bool
    ) -> str | None:
        """What the template writes after the last assistant turn of ``history`` for the ``new``
        messages, up to the next assistant header (None: it renders the history differently then)."""
        marked = [*history[:-1], {"role": "assistant", "content": _MARK}]
        before = self._render(marked, tools, False)
        after = self._render([*marked, *new], tools, True)
        if not after.startswith(before) or _MARK not in before:
            return None
        closing = before[before.rindex(_MARK) + len(_MARK) :]
        eos = getattr(self.tokenizer, "eos_token", None)
        if ended_at_eos and eos and closing.startswith(eos):
            closing = closing[len(eos) :]
        return closing + after[len(before) :]

    def _context_completion(self, ep: _Episode, request: Any, version: int) -> None:
        row = ep.row
        if isinstance(request.prompt, list):
            ids = [int(t) for t in request.prompt]
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab}).", "bad_tokens", "prompt")
            have = row.prompt_ids + row.tokens
            if row.prompt_ids and len(ids) >= len(have) and ids[: len(have)] == have:
                extra = ids[len(have) :]
            else:
                self._restart(ep, ids)
                extra = []
            text = None
        else:
            text = request.prompt
            if ep.context is not None and text.startswith(ep.context) and row.prompt_ids:
                extra = self._encode(text[len(ep.context) :]) if len(text) > len(ep.context) else []
            else:
                self._restart(ep, self._encode(text))
                extra = []
        if extra:
            row.write(extra, version)
            row.turns.append(Turn(role="env", text=self.tokenizer.decode(extra), tokens=len(extra)))
        ep.context = text

    # ------------------------------------------------------------ decoding
    def _decoding(self) -> list[tuple[_Episode, Any]]:
        return [(e, r) for e in self._running() if e.request is not None for r in e.request.rows if not r.finished]

    def pump(self, gen: Any, rng: torch.Generator, version: int, chunk: int | None) -> int:
        """One round: start waiting episodes, take requests and ends, decode one chunk of every request
        in flight and answer those that finished. Returns the tokens sampled."""
        from flowrl.runtime.rollout import absorb, rows_to_rollout

        if self.context is None and isinstance(getattr(gen, "context", None), int):
            self.context = gen.context
        self._deadlines(version)
        self._settle(version)
        todo = self._decoding()
        if not todo:
            return 0
        rows = [r for _, r in todo]
        want = max(e.request.limit - (len(r.tokens) - e.request.start) for e, r in todo)  # type: ignore[union-attr]
        out = gen.resume(
            rows_to_rollout(rows, pad_id(self.tokenizer), self.greedy),
            generator=rng,
            max_new_tokens=max(1, min(want, chunk or want)),
        )
        new = absorb(rows, out, gen.version)
        self._count("decode_calls")
        eos = self.tokenizer.eos_token_id
        for ep, row in todo:
            req = ep.request
            assert req is not None
            sampled = row.tokens[req.start :]
            reason = "stop" if row.finished and sampled and sampled[-1] == eos else "length"
            if len(sampled) > req.limit:  # a chunk ran past the request's max_tokens
                row.cut(req.start + req.limit)
                self._count("cut_tokens", len(sampled) - req.limit)
                row.finished, reason = True, "length"
            elif len(sampled) == req.limit or len(row.tokens) >= self.budget:
                row.finished, reason = True, reason if row.finished else "length"
            if req.stop:
                at = _stop_at(self.tokenizer, row.tokens[req.start :], req.stop)
                if at is not None:
                    row.cut(req.start + at)
                    row.finished, reason = True, "stop"
            if row.finished:
                req.reasons.append(reason)
        for ep in {id(e): e for e, _ in todo}.values():
            req = ep.request
            if req is not None and all(r.finished for r in req.rows):
                self._answer(ep)
        return new

    def _answer(self, ep: _Episode) -> None:
        req = ep.request
        assert req is not None
        request, chat = req.call.request, req.call.chat
        choices, replies = [], []
        for i, (row, reason) in enumerate(zip(req.rows, req.reasons)):
            ids = row.tokens[req.start :]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            stop = next((s for s in req.stop if s in text), None)
            if stop is not None:
                text = text[: text.index(stop)]
            calls: tuple[ToolCall, ...] = ()
            if chat and request.tools:
                from flowrl.tasks.tools import parse_tool_calls

                calls, _ = parse_tool_calls(text)
            turn = Turn(role="assistant", text=text, tool_calls=calls, tokens=len(ids))
            row.turns.append(turn)
            choice: dict[str, Any] = {"index": i, "finish_reason": "tool_calls" if calls else reason}
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    from flowrl.tasks.tools import _CALL

                    message["content"] = _CALL.sub("", text).strip() or None
                    message["tool_calls"] = [
                        {
                            "id": f"call_{ep.id}_{ep.requests}_{j}",
                            "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                        }
                        for j, c in enumerate(calls)
                    ]
                choice["message"] = message
                replies.append(_norm(message))
            else:
                choice["text"] = text
            if request.logprobs:
                choice["logprobs"] = self._logprobs(row, req.start, chat)
            if request.return_token_ids:
                choice["token_ids"] = ids
            choices.append(choice)
        main = req.rows[0]
        _adopt(ep.row, main)
        if chat:  # the next request continues after one of these replies
            ep.replies, ep.choices = replies, req.rows
        else:
            ep.context = (ep.context if ep.context is not None else "") + choices[0]["text"]
        used = len(main.prompt_ids) + req.start
        body: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{ep.id}-{ep.requests}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": used,
                "completion_tokens": sum(len(r.tokens) - req.start for r in req.rows),
                "total_tokens": used + sum(len(r.tokens) - req.start for r in req.rows),
            },
        }
        if request.return_token_ids:
            body["prompt_token_ids"] = main.prompt_ids + main.tokens[: req.start]
        ep.waited += time.monotonic() - req.call.received
        ep.request = None
        req.call.future.set_result(body)

    def _logprobs(self, row: Any, start: int, chat: bool) -> dict[str, Any]:
        ids, lps = row.tokens[start:], row.logprobs[start:]
        pieces = [self.tokenizer.decode([t]) for t in ids]
        if chat:
            return {
                "content": [
                    {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                    for p, lp in zip(pieces, lps)
                ]
            }
        offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    # ------------------------------------------------------------ rollouts
    def run(self, gen: Any, prompts: Sequence[Prompt], n: int, rng: torch.Generator, version: int) -> Sequences:
        """``n`` episodes per prompt, played whole (sync rollouts): their trajectories as Sequences."""
        from flowrl.runtime.rollout import rows_to_rollout

        rows = self.launch(list(range(len(prompts))), prompts, n, 0)
        while not all(r.ended for r in rows):
            self.pump(gen, rng, version, None)
        seqs = rows_to_rollout(rows, pad_id(self.tokenizer), self.greedy, episodes=True).sequences
        return replace(seqs, prompt_index=torch.tensor([r.group for r in rows], dtype=torch.long))

    def enforce(self, buffer: Any, version: int, step: int) -> int:
        """Before a chunked step at ``version``: an episode whose request in flight holds tokens older
        than the staleness bound has that request sampled again from its start; one whose earlier
        tokens are (or an ended one) plays again from its prompt, as does a row no episode plays (restored
        from a checkpoint). Returns the episodes played again."""
        live = {e.row.episode: e for e in self.episodes.values() if e.state != "over"}
        again = 0
        for row in buffer.rows:
            ep = live.get(row.episode) if not row.ended else None
            if not row.ended and ep is None:  # restored unfinished: its agent is gone
                self._replay(row, buffer.prompts[row.group], step)
                again += 1
                continue
            req = ep.request if ep is not None else None
            floor = version - buffer.eta
            if not buffer.too_old(row, version):
                if req is None or all(min(r.versions[req.start :], default=version) >= floor for r in req.rows):
                    continue
                for r in req.rows:  # abort and resume: the request's tokens sampled again
                    r.cut(req.start)
                    r.finished = False
                req.reasons.clear()
                self._count("aborted_requests")
                continue
            if ep is not None:
                self._stop(ep, ApiError(410, "the episode's tokens passed the staleness bound.", "stale"))
                self.episodes.pop(ep.id, None)
            self._replay(row, buffer.prompts[row.group], step)
            again += 1
        return again

    def _replay(self, row: Any, prompt: Prompt, step: int) -> None:
        row.restart(step)
        row.prompt_ids = []
        self._open(row, prompt)
        self._count("replayed")

    def take_metrics(self, seqs: Sequences) -> dict[str, float]:
        episodes = seqs.episodes or ()
        n = max(len(episodes), 1)
        out: dict[str, float] = {
            "turns": round(sum(sum(t.role == "assistant" for t in e) for e in episodes) / n, 4),
            "agent_reward": round(sum(sum(t.reward for t in e) for e in episodes) / n, 4),
            "env_tokens": round(sum(sum(t.tokens for t in e if t.role != "assistant") for e in episodes) / n, 4),
        }
        for key in (
            "episodes", "requests", "agent_errors", "timeouts", "bad_rewards", "no_reward", "refused", "forks",
            "template_forks", "aborted_requests", "replayed", "sampling_ignored", "cut_tokens", "decode_calls",
            "unsettled_decodes",
        ):  # fmt: skip
            out[key] = int(self.counts.get(key, 0))
        if self.endpoint is not None:
            out["bad_requests"] = int(sum(self.endpoint.counts.values()))
            self.endpoint.counts = {}
        self.counts = {}
        return out


def _copy(row: Any) -> Any:
    return replace(
        row, tokens=list(row.tokens), logprobs=list(row.logprobs), versions=list(row.versions),
        action=list(row.action), turns=list(row.turns),
    )  # fmt: skip


def _state(ep: _Episode) -> tuple:
    """What a request may change of ``ep`` before it is admitted (its trajectory and history)."""
    row = ep.row
    return (
        list(row.prompt_ids), list(row.tokens), list(row.logprobs), list(row.versions), list(row.action),
        list(row.turns), ep.history, list(ep.replies), list(ep.choices), ep.context,
    )  # fmt: skip


def _restore(ep: _Episode, state: tuple) -> None:
    row = ep.row
    row.prompt_ids, row.tokens, row.logprobs, row.versions, row.action, row.turns = (list(x) for x in state[:6])
    ep.history, ep.replies, ep.choices, ep.context = state[6], list(state[7]), list(state[8]), state[9]


def _adopt(row: Any, other: Any) -> None:
    """``row`` (the trajectory) takes the tokens and turns of another choice of the same request."""
    row.tokens, row.logprobs, row.versions = list(other.tokens), list(other.logprobs), list(other.versions)
    row.action, row.turns = list(other.action), list(other.turns)


def _stop_at(tokenizer: Any, ids: list[int], stop: Sequence[str]) -> int | None:
    """The fewest of ``ids`` whose text holds a stop string (None: none does)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in stop):
        return None
    for k in range(1, len(ids) + 1):
        if any(s in tokenizer.decode(ids[:k], skip_special_tokens=True) for s in stop):
            return k
    return None


def build(node: Any, factory_or_fn: Callable[..., Any], registered: bool, task: Any, options: dict[str, Any],
          tokenizer: Any, template: str | None, budget: int, model: str) -> AgentRollouts:  # fmt: skip
    """The agent rollouts of generate node ``node``: a registered agent's factory is called with the
    task and the node's options; a plain callable takes the options with its other arguments."""
    if registered:
        try:
            agent = factory_or_fn(task, **options)
        except FlowRLError as exc:
            if f"node '{node.name}'" in str(exc):
                raise
            try:
                named = type(exc)(f"node '{node.name}': {exc}")
            except TypeError:
                named = GraphError(f"node '{node.name}': {exc}")
            raise named from exc
        except Exception as exc:
            raise GraphError(f"node '{node.name}': agent '{node.agent}' failed to start: {exc}") from exc
        if not callable(agent):
            raise GraphError(
                f"node '{node.name}': agent '{node.agent}' returned {type(agent).__name__}, not a callable."
            )
        options = {}
    else:
        agent = factory_or_fn
    return AgentRollouts(
        node=node.name,
        model=model,
        agent=agent,
        agent_name=node.agent,
        options=dict(options),
        tokenizer=tokenizer,
        template=template or PLAIN_TEMPLATE,
        budget=budget,
        turns=node.turns,
        turn_tokens=node.turn_tokens or max(budget // node.turns, 1),
        timeout=node.timeout,
        concurrency=node.concurrency,
        failure_reward=node.failure_reward,
        greedy=node.greedy,
    )
