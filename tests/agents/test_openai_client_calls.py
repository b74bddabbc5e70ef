"""The ``openai`` client's ordinary calls work against the endpoint, and what they return is what the
trajectory records: choices, token ids, log-probs, streamed text, stop strings, usage, completions
continued by token ids."""

from __future__ import annotations

import pytest
from agent_play import play, rewards, trajectory

openai = pytest.importorskip("openai")

CALC = {
    "type": "function",
    "function": {"name": "calc", "description": "Evaluate.", "parameters": {"type": "object", "properties": {}}},
}
IDS = {"return_token_ids": True}


def client(base_url, api_key):
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def test_chat_with_tools_and_the_model_list(actor):
    seen = {}

    def agent(base_url, api_key, model, messages):
        c = client(base_url, api_key)
        seen["models"] = [m.id for m in c.models.list()]
        r = c.chat.completions.create(model=model, messages=messages, tools=[CALC], max_tokens=6, extra_body=IDS)
        seen["reply"] = r
        return 1.0

    seqs, metrics = play(actor, agent)
    r = seen["reply"]
    assert seen["models"] == ["actor"]
    assert r.object == "chat.completion" and r.model == "actor" and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    ids, prompt_ids = r.choices[0].model_extra["token_ids"], r.model_extra["prompt_token_ids"]
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    prompt, response, action = trajectory(seqs)
    assert prompt == prompt_ids and response == ids and all(action)
    assert rewards(seqs) == [1.0]


def test_continuing_with_the_second_choice_trains_on_its_tokens(actor):
    seen = {}

    def agent(base_url, api_key, model, messages):
        c = client(base_url, api_key)
        r = c.chat.completions.create(model=model, messages=messages, n=2, max_tokens=8, extra_body=IDS)
        seen["first"] = r
        history = [*messages, r.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
        seen["second"] = c.chat.completions.create(model=model, messages=history, max_tokens=4, extra_body=IDS)
        return 1.0

    seqs, metrics = play(actor, agent, seed=3)
    first, second = seen["first"], seen["second"]
    a, b = (ch.model_extra["token_ids"] for ch in first.choices)
    assert a != b, "the two choices sampled the same tokens: pick another seed"
    assert first.usage.completion_tokens == len(a) + len(b)
    prompt, response, action = trajectory(seqs)
    assert prompt == first.model_extra["prompt_token_ids"]
    assert response[: len(b)] == b and all(action[: len(b)])  # choice 1's tokens, trained
    assert prompt + response == second.model_extra["prompt_token_ids"] + second.choices[0].model_extra["token_ids"]
    assert metrics["forks"] == 0 and metrics["requests"] == 2


def test_logprobs_come_one_per_sampled_token_and_match_the_trajectory(actor):
    seen = {}

    def agent(base_url, api_key, model, messages):
        r = client(base_url, api_key).chat.completions.create(
            model=model, messages=messages, logprobs=True, max_tokens=8, extra_body=IDS
        )
        seen["r"] = r
        return 0.0

    seqs, _ = play(actor, agent)
    choice = seen["r"].choices[0]
    content = choice.logprobs.content
    assert len(content) == len(choice.model_extra["token_ids"]) == seen["r"].usage.completion_tokens
    assert all(lp.logprob <= 0.0 and isinstance(lp.token, str) for lp in content)
    n = len(content)
    assert [round(float(x), 5) for x in seqs.logprobs[0, :n]] == [round(lp.logprob, 5) for lp in content]


def test_a_streamed_chat_completion_through_the_client_is_the_recorded_turn(actor):
    seen = {}

    def agent(base_url, api_key, model, messages):
        stream = client(base_url, api_key).chat.completions.create(
            model=model, messages=messages, max_tokens=8, stream=True
        )
        chunks = list(stream)
        seen["text"] = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        seen["finish"] = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        return 1.0

    seqs, metrics = play(actor, agent)
    _, response, _ = trajectory(seqs)
    assert seen["text"] == actor.tokenizer.decode(response, skip_special_tokens=True)
    assert seen["finish"] and seen["finish"][-1] in ("stop", "length")
    assert rewards(seqs) == [1.0] and metrics["agent_errors"] == 0


def test_completions_continue_exactly_from_the_token_ids_they_were_given(actor):
    seen = {}

    def agent(base_url, api_key, model, prompt):
        c = client(base_url, api_key)
        r = c.completions.create(model=model, prompt=prompt, max_tokens=6, extra_body=IDS)
        seen["first"] = r
        ids = r.model_extra["prompt_token_ids"] + r.choices[0].model_extra["token_ids"]
        seen["extra"] = actor.tokenizer.encode(" then", add_special_tokens=False)
        r2 = c.completions.create(model=model, prompt=ids + seen["extra"], max_tokens=6, extra_body=IDS)
        seen["second"] = r2
        return 1.0

    seqs, metrics = play(actor, agent)
    first, second = seen["first"], seen["second"]
    assert first.object == "text_completion" and isinstance(first.choices[0].text, str)
    p1, t1 = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    assert p1 == actor.tokenizer.encode("12*34:", add_special_tokens=False)
    t2 = second.choices[0].model_extra["token_ids"]
    prompt, response, action = trajectory(seqs)
    assert metrics["forks"] == 0
    assert prompt == p1 and response == t1 + seen["extra"] + t2
    assert action == [1.0] * len(t1) + [0.0] * len(seen["extra"]) + [1.0] * len(t2)


def test_a_stop_string_ends_the_reply_before_it(actor):
    seen = {}
    stops = ["a", "e", "o", "1"]

    def agent(base_url, api_key, model, messages):
        seen["r"] = client(base_url, api_key).chat.completions.create(
            model=model, messages=messages, n=8, max_tokens=16, stop=stops, extra_body=IDS
        )
        return 1.0

    seqs, _ = play(actor, agent, budget=128, turn_tokens=16)
    stopped = 0
    tok = actor.tokenizer
    for choice in seen["r"].choices:
        content, ids = choice.message.content, choice.model_extra["token_ids"]
        assert not any(s in content for s in stops)
        text = tok.decode(ids, skip_special_tokens=True)
        if any(s in text for s in stops):
            stopped += 1
            assert choice.finish_reason == "stop"
            assert any(text.endswith(s) for s in stops)  # sampling ended at the stop string
            assert text.startswith(content) and len(text) - len(content) <= max(map(len, stops))
    assert stopped >= 1
    _, response, _ = trajectory(seqs)
    assert response == seen["r"].choices[0].model_extra["token_ids"]  # the trajectory: the first choice


def test_an_async_agent_with_the_async_client_plays_its_episodes(actor):
    seen = []

    async def agent(base_url, api_key, model, messages):
        c = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        r = await c.chat.completions.create(model=model, messages=messages, max_tokens=6, extra_body=IDS)
        assert r.choices[0].model_extra["token_ids"] is not None
        stream = await c.completions.create(model=model, prompt="12*34:", max_tokens=4, stream=True)
        seen.append("".join([ch.choices[0].text async for ch in stream]))
        return 0.5

    seqs, metrics = play(actor, agent, n=2)
    assert rewards(seqs) == [0.5, 0.5] and metrics["agent_errors"] == 0 and metrics["requests"] == 4
    assert len(seen) == 2 and all(isinstance(s, str) for s in seen)
