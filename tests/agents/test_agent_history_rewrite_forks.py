"""An agent that rewrites its history (drops or edits a message) starts the trajectory again: the
fork is counted and training sees the last one, exactly as its last request was told."""

from __future__ import annotations

import pytest
from agent_play import play, trajectory

openai = pytest.importorskip("openai")
IDS = {"return_token_ids": True}


def test_dropping_messages_forks_and_the_last_trajectory_is_trained(actor):
    seen = {}

    def agent(base_url, api_key, model, messages):
        c = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        r1 = c.chat.completions.create(model=model, messages=messages, max_tokens=4, extra_body=IDS)
        history = [*messages, r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go"}]
        r2 = c.chat.completions.create(model=model, messages=history, max_tokens=4, extra_body=IDS)
        rewritten = [*messages, {"role": "user", "content": "once more"}]  # the first reply dropped
        seen["last"] = c.chat.completions.create(model=model, messages=rewritten, max_tokens=4, extra_body=IDS)
        seen["r2"] = r2
        return 1.0

    seqs, metrics = play(actor, agent)
    last = seen["last"]
    assert metrics["forks"] == 1 and metrics["requests"] == 3
    prompt, response, action = trajectory(seqs)
    assert prompt == last.model_extra["prompt_token_ids"]
    assert response == last.choices[0].model_extra["token_ids"] and all(action)
    assert "once more" in actor.tokenizer.decode(prompt)


def test_editing_the_models_reply_forks(actor):
    seen = {}

    def agent(base_url, api_key, model, messages):
        c = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        r1 = c.chat.completions.create(model=model, messages=messages, max_tokens=4)
        edited = {"role": "assistant", "content": (r1.choices[0].message.content or "") + " edited"}
        history = [*messages, edited, {"role": "user", "content": "go"}]
        seen["last"] = c.chat.completions.create(model=model, messages=history, max_tokens=4, extra_body=IDS)
        return 1.0

    seqs, metrics = play(actor, agent)
    assert metrics["forks"] == 1
    prompt, response, _ = trajectory(seqs)
    assert prompt == seen["last"].model_extra["prompt_token_ids"]  # the edit is prompt, never trained
    assert " edited" in actor.tokenizer.decode(prompt)


def test_a_continued_history_does_not_fork(actor):
    def agent(base_url, api_key, model, messages):
        c = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        history = list(messages)
        for k in range(3):
            r = c.chat.completions.create(model=model, messages=history, max_tokens=4)
            history += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"t{k}"}]
        return 1.0

    seqs, metrics = play(actor, agent, budget=96)
    assert metrics["forks"] == 0 and metrics["template_forks"] == 0 and metrics["requests"] == 3
    _, _, action = trajectory(seqs)
    assert 0 < sum(action) < len(action)  # the user turns between the replies are masked out
