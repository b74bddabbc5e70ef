"""Agent episodes through the OpenAI-compatible endpoint record exactly what the engine sampled.

A tool-calling agent written with the plain ``openai`` client plays multi-turn episodes against the
tiny tool model (tests/conftest.py ``tool_model``: it calls ``mul`` in the Hermes format, then
answers). A pass-through engine wrapper notes every token the engine samples after its exact
context; each trajectory's trained tokens must be those (token, log-prob, weight version), the tool
results between them masked out, and what the agent was told (its token ids) the same tokens: no
re-tokenisation, under sync rollouts and under async ones whose weights change between chunks."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from flowrl import api
from flowrl.contract.data import Prompt
from flowrl.contract.layout import RolloutPolicy
from flowrl.plugins.manager import registry
from flowrl.runtime.agents import AgentRollouts
from flowrl.runtime.executor import PlanExecutor
from flowrl.runtime.rollout import StepRollout

pytestmark = pytest.mark.slow  # agent episodes over real runs: seconds each

openai = pytest.importorskip("openai")

MUL = {
    "type": "function",
    "function": {
        "name": "mul",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


class Spy:
    """The engine as it is, noting each sampled token under its exact context (prompt + tokens before)."""

    def __init__(self, engine):
        self.engine = engine
        self.sampled: dict[tuple[int, ...], tuple[int, float, int]] = {}

    @property
    def version(self):
        return self.engine.version

    def resume(self, rollout, *, generator, max_new_tokens=None):
        seqs = rollout.sequences
        before = seqs.response_mask.sum(-1).long().tolist()
        out = self.engine.resume(rollout, generator=generator, max_new_tokens=max_new_tokens)
        o = out.sequences
        after = o.response_mask.sum(-1).long().tolist()
        for i in range(len(o)):
            prompt = o.prompt_ids[i][o.prompt_mask[i].bool()].tolist()
            ids = o.response_ids[i].tolist()
            for j in range(before[i], after[i]):
                self.sampled[tuple(prompt + ids[:j])] = (ids[j], float(out.logprobs[i, j]), self.engine.version)
        return out


def tool_agent(log):
    """An agent of the kind users write: the openai client, a tool it runs itself, several turns."""

    def run(base_url, api_key, model, messages):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages, seen = list(messages), []
        for _ in range(3):
            r = client.chat.completions.create(
                model=model, messages=messages, tools=[MUL], logprobs=True, max_tokens=96,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            choice = r.choices[0]
            seen.append(
                {
                    "prompt": r.model_extra["prompt_token_ids"],
                    "ids": choice.model_extra["token_ids"],
                    "logprobs": [c.logprob for c in choice.logprobs.content],
                }
            )
            message = choice.message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] * args["b"])})
        log.append(seen)
        return 1.0 if "42" in (message.content or "") else 0.0

    return run


@pytest.fixture(scope="module")
def actor(tool_model):
    graph, plan = api.plan(
        "grpo",
        overrides=[
            f"model={tool_model['model']}",
            f"data.train={tool_model['data']}",
            f"data.chat_template={tool_model['template']}",
            "data.verifier=none",
            "rollout.temperature=0.7",
        ],  # fmt: skip
        emit=lambda s: None,
    )
    trainers, _ = PlanExecutor(registry()).engines(graph, plan)
    return trainers["actor"]


def rollouts(actor, tool_model, log) -> AgentRollouts:
    return AgentRollouts(
        node="episodes", model="actor", agent=tool_agent(log), agent_name="tool_agent", options={},
        tokenizer=actor.tokenizer, template=open(tool_model["template"]).read(), budget=320, turns=3,
        turn_tokens=96, timeout=60.0, concurrency=8, failure_reward=0.0,
    )  # fmt: skip


PROMPTS = [
    Prompt(text=q, answer="42", messages=({"role": "user", "content": q},), templated=True)
    for q in ("What is 6 * 7?", "What is 2 * 3?")
]


def check_recorded(seqs, spy, log, tok):
    """Every trained token was sampled after exactly its context, with its log-prob and version; every
    other response token is masked; the agent's token ids are the trajectory's."""
    tool_turns = 0
    for i in range(len(seqs)):
        prompt = seqs.prompt_ids[i][seqs.prompt_mask[i].bool()].tolist()
        n = int(seqs.response_mask[i].sum())
        ids = seqs.response_ids[i, :n].tolist()
        action = seqs.action_mask[i, :n].tolist()
        for j in range(n):
            key = tuple(prompt + ids[:j])
            if action[j]:
                token, logprob, version = spy.sampled[key]
                assert ids[j] == token
                assert float(seqs.logprobs[i, j]) == pytest.approx(logprob, abs=1e-6)
                assert int(seqs.versions[i, j]) == version
        turns = seqs.episodes[i]
        tool_turns += sum(t.role == "tool" for t in turns)
        assert sum(t.tokens for t in turns) == n
        assert all(t.tool_calls for t in turns[:-2] if t.role == "assistant")  # every turn but the answer called
    assert tool_turns > 0  # the model called the tool: tool results sat between its turns, masked
    # what each agent was told: request k's prompt is the trajectory so far, its ids the next sampled tokens
    trajectories = {
        tuple(seqs.prompt_ids[i][seqs.prompt_mask[i].bool()].tolist()
              + seqs.response_ids[i, : int(seqs.response_mask[i].sum())].tolist())
        for i in range(len(seqs))
    }  # fmt: skip
    for seen in log:
        last = seen[-1]
        assert tuple(last["prompt"] + last["ids"]) in trajectories
        for earlier, later in zip(seen, seen[1:]):
            assert later["prompt"][: len(earlier["prompt"]) + len(earlier["ids"])] == earlier["prompt"] + earlier["ids"]
        for request in seen:
            for k, (t, lp) in enumerate(zip(request["ids"], request["logprobs"])):
                assert spy.sampled[tuple(request["prompt"] + request["ids"][:k])][:2] == (
                    t,
                    pytest.approx(lp, abs=1e-6),
                )
    assert tok is not None


def test_sync_agent_episodes_train_on_exactly_the_sampled_tokens(actor, tool_model):
    log: list = []
    agents, spy = rollouts(actor, tool_model, log), Spy(actor)
    try:
        seqs = agents.run(spy, PROMPTS, 2, torch.Generator().manual_seed(0), actor.version)
        metrics = agents.take_metrics(seqs)
    finally:
        agents.close()
    assert len(seqs) == 4 and len(log) == 4
    check_recorded(seqs, spy, log, actor.tokenizer)
    assert metrics["requests"] >= 5 and metrics["agent_errors"] == 0 and metrics["forks"] == 0
    rewards = [sum(t.reward for t in e) for e in seqs.episodes]
    assert set(rewards) <= {0.0, 1.0} and max(rewards) == 1.0


def test_async_agent_episodes_keep_each_tokens_version_across_weight_updates(actor, tool_model):
    log: list = []
    agents, spy = rollouts(actor, tool_model, log), Spy(actor)
    policy = RolloutPolicy(mode="async", staleness=4)
    source = StepRollout(
        model="actor", generator=spy, n=2, greedy=False, policy=policy, prompts_per_step=2, chunk_tokens=4,
        stream_groups=1, pad_id=actor.tokenizer.pad_token_id, draw=lambda k: PROMPTS[:k], agents=agents,
    )  # fmt: skip
    start = actor.version
    try:
        run = source.run(0, start, PROMPTS, torch.Generator().manual_seed(1))
        try:
            while True:
                next(run)
                actor.version += 1  # new weights between decode chunks (the tokens' versions say which)
        except StopIteration as stop:
            result = stop.value
    finally:
        agents.close()
        actor.version = start
    seqs = result.sequences
    check_recorded(seqs, spy, log, actor.tokenizer)
    versions = {int(v) for i in range(len(seqs)) for v, a in zip(seqs.versions[i], seqs.action_mask[i]) if a}
    assert len(versions) > 2  # requests spanned weight updates, each token stamped with its own


def test_the_tokenizer_of_the_tool_model_renders_the_tool_schema(tool_model):
    tok = transformers.AutoTokenizer.from_pretrained(tool_model["model"])
    assert "mul" in tok.apply_chat_template(
        [{"role": "user", "content": "x"}],
        tools=[MUL],
        tokenize=False,
        chat_template=open(tool_model["template"]).read(),
    )
