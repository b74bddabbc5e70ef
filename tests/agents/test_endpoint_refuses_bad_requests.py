"""Whatever an agent sends, the endpoint answers: a malformed, too large, unauthorised or out-of-turn
request gets an OpenAI error (its status, a JSON body naming the problem), the episode goes on, and
the refusals are counted. Raw HTTP (httpx), the way a buggy client would send it."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
from agent_play import play, rewards, trajectory

from flowrl.runtime import agents as agents_module
from flowrl.runtime.endpoint import MAX_BODY

GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def probe(cases: list[tuple[str, str, Any, dict]], log: dict, then_good: int = 0):
    """An agent that sends each (name, path, body, headers) case, then ``then_good`` good requests,
    noting each answer's (status, JSON body) under its name."""

    def agent(base_url, api_key, episode_id):
        auth = {"Authorization": f"Bearer {api_key}"}
        with httpx.Client(timeout=30) as http:
            for name, path, body, headers in cases:
                url = base_url + path if path.startswith("/") else base_url.rsplit("/episodes/", 1)[0] + "/" + path
                kwargs = {"content": body} if isinstance(body, (bytes, str)) else {"json": body}
                r = (
                    http.post(url, headers={**auth, **headers}, **kwargs)
                    if body is not None
                    else http.get(url, headers={**auth, **headers})
                )
                log[name] = (r.status_code, r.json())
            for k in range(then_good):
                r = http.post(base_url + "/chat/completions", headers=auth, json=GOOD)
                log[f"good{k}"] = (r.status_code, r.json())
        return 1.0

    return agent


def error(log, name) -> dict:
    status, body = log[name]
    assert set(body) == {"error"} and {"message", "type", "code", "param"} <= set(body["error"]), body
    return body["error"]


MALFORMED = [
    ("not_json", "/chat/completions", b"{not json", {}),
    ("wrong_type", "/chat/completions", {"messages": "hello"}, {}),
    ("n_is_text", "/chat/completions", {**GOOD, "n": "two"}, {}),
    ("no_messages", "/chat/completions", {"model": "actor"}, {}),
    ("empty_messages", "/chat/completions", {"messages": []}, {}),
    ("bad_role", "/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, {}),
    ("message_not_object", "/chat/completions", {"messages": ["hi"]}, {}),
    ("content_number", "/chat/completions", {"messages": [{"role": "user", "content": 7}]}, {}),
    ("n_zero", "/chat/completions", {**GOOD, "n": 0}, {}),
    ("n_hundred", "/chat/completions", {**GOOD, "n": 100}, {}),
    ("max_tokens_zero", "/chat/completions", {**GOOD, "max_tokens": 0}, {}),
    ("max_tokens_negative", "/completions", {"prompt": "ab", "max_tokens": -5}, {}),
    ("five_stops", "/chat/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, {}),
    ("empty_stop", "/chat/completions", {**GOOD, "stop": [""]}, {}),
    ("bad_tool", "/chat/completions", {**GOOD, "tools": [{"type": "function"}]}, {}),
    ("empty_prompt", "/completions", {"prompt": ""}, {}),
    ("prompt_ids_out_of_vocab", "/completions", {"prompt": [1, 2, 10**9]}, {}),
    ("prompt_ids_negative", "/completions", {"prompt": [-1]}, {}),
    ("unencodable", "/chat/completions", {"messages": [{"role": "user", "content": "héllo ☃"}]}, {}),
    ("huge", "/chat/completions", {"messages": [{"role": "user", "content": "a" * (MAX_BODY + 10)}]}, {}),
    ("wrong_key", "/chat/completions", GOOD, {"Authorization": "Bearer nope"}),
    ("no_key", "/chat/completions", GOOD, {"Authorization": ""}),
    ("unknown_episode", "episodes/nobody-1-abc/v1/chat/completions", GOOD, {}),
    ("unknown_route", "/embeddings", GOOD, {}),
    ("run_wide_unknown_model", "v1/chat/completions", GOOD, {}),
    ("root_route", "v2/chat/completions", GOOD, {}),
    ("get_on_post_route", "/chat/completions", None, {}),
]


@pytest.fixture(scope="module")
def refused(actor):
    log: dict = {}
    seqs, metrics = play(actor, probe(MALFORMED, log, then_good=1), turns=1)
    return log, seqs, metrics


@pytest.mark.parametrize(
    "name",
    ["not_json", "wrong_type", "n_is_text", "no_messages", "empty_messages", "bad_role", "message_not_object",
     "content_number", "n_zero", "n_hundred", "max_tokens_zero", "max_tokens_negative", "five_stops", "empty_stop",
     "bad_tool", "empty_prompt", "prompt_ids_out_of_vocab", "prompt_ids_negative", "unencodable"],
)  # fmt: skip
@pytest.mark.slow
def test_a_malformed_request_is_a_400_naming_what_is_wrong(refused, name):
    log, _, _ = refused
    assert log[name][0] == 400, log[name]
    assert error(log, name)["type"] == "invalid_request_error"


@pytest.mark.slow
def test_the_errors_name_the_field_at_fault(refused):
    log, _, _ = refused
    assert error(log, "bad_role")["param"] == "messages[0].role"
    assert error(log, "n_hundred")["param"] == "n" and "100" in error(log, "n_hundred")["message"]
    assert error(log, "max_tokens_zero")["param"] == "max_tokens"
    assert error(log, "unencodable")["code"] == "unencodable"
    assert "not JSON" in error(log, "not_json")["message"]


def test_a_huge_body_is_a_413(refused):
    log, _, _ = refused
    assert log["huge"][0] == 413 and error(log, "huge")["code"] == "too_large"


def test_a_wrong_or_missing_key_is_a_401(refused):
    log, _, _ = refused
    assert log["wrong_key"][0] == 401 and log["no_key"][0] == 401


def test_an_unknown_episode_is_a_410_and_an_unknown_route_a_404_in_json(refused):
    log, _, _ = refused
    assert log["unknown_episode"][0] == 410 and error(log, "unknown_episode")["code"] == "episode_over"
    # the run-wide URL: the model names the episode, here none of this run's
    assert log["run_wide_unknown_model"][0] == 410
    for name in ("unknown_route", "root_route", "get_on_post_route"):
        assert log[name][0] == 404 and error(log, name)["code"] == "no_route"


def test_after_the_refusals_the_episode_is_served_and_trained(refused):
    log, seqs, metrics = refused
    status, body = log["good0"]
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    assert rewards(seqs) == [1.0] and metrics["agent_errors"] == 0 and metrics["requests"] == 1
    assert metrics["bad_requests"] >= len(MALFORMED) - 1  # the refusals are counted
    _, response, action = trajectory(seqs)
    assert sum(action) == body["usage"]["completion_tokens"]


def test_more_requests_than_turns_is_a_429_then_the_budget_a_400(actor):
    log: dict = {}
    long_turn = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 16}
    cases = [("first", "/chat/completions", long_turn, {}), ("second", "/chat/completions", long_turn, {}),
             ("third", "/chat/completions", long_turn, {})]  # fmt: skip
    play(actor, probe(cases, log), turns=2)
    assert [log[k][0] for k in ("first", "second", "third")] == [200, 200, 429]
    assert error(log, "third")["code"] == "turns_exhausted"

    log.clear()
    first = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}

    def over_budget(base_url, api_key):
        with httpx.Client(timeout=30) as http:
            auth = {"Authorization": f"Bearer {api_key}"}
            r = http.post(base_url + "/chat/completions", headers=auth, json=first)
            log["first"] = (r.status_code, r.json())
            messages = [*first["messages"], r.json()["choices"][0]["message"], {"role": "user", "content": "y" * 80}]
            r = http.post(base_url + "/chat/completions", headers=auth, json={"messages": messages})
            log["second"] = (r.status_code, r.json())
        return 0.5

    seqs, metrics = play(actor, over_budget, budget=40)
    assert log["first"][0] == 200 and log["second"][0] == 400, log
    assert error(log, "second")["code"] == "context_length_exceeded"
    assert rewards(seqs) == [0.5]
    _, response, _ = trajectory(seqs)
    assert len(response) <= 40  # the trajectory keeps to the response budget


def test_a_second_request_while_one_is_in_flight_is_a_409(actor, monkeypatch):
    """Two episodes: the first sends two requests at once while the second has sent none, so whichever
    request arrives first waits to be decoded (the driver waits for every running episode's request) and
    the other is refused; the second episode ends once the refusal came, and the held request is served."""
    monkeypatch.setattr(agents_module, "SETTLE_S", 60.0)  # no decode without the second episode
    log: list = []
    refused = threading.Event()
    roles = iter(["sender", "idle"])
    role_lock = threading.Lock()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}

    def twice_at_once(base_url, api_key):
        with role_lock:
            role = next(roles)
        if role == "idle":
            assert refused.wait(30)
            return 1.0
        barrier = threading.Barrier(2)

        def send():
            barrier.wait()
            with httpx.Client(timeout=30) as http:
                r = http.post(base_url + "/chat/completions", headers={"Authorization": f"Bearer {api_key}"}, json=body)
                log.append((r.status_code, r.json()))
                if r.status_code == 409:
                    refused.set()

        threads = [threading.Thread(target=send) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return 1.0

    seqs, metrics = play(actor, twice_at_once, n=2, turns=4)
    statuses = sorted(s for s, _ in log)
    assert statuses == [200, 409], log
    assert all(b["error"]["code"] == "busy" for s, b in log if s == 409)
    assert rewards(seqs) == [1.0, 1.0] and metrics["unsettled_decodes"] == 0


def test_a_request_to_an_episode_that_is_over_is_a_410(actor):
    seen: dict = {}

    def agent(base_url, api_key):
        seen["url"], seen["key"] = base_url, api_key
        return 1.0

    agents_log: dict = {}

    def later(base_url, api_key):  # the second episode asks on the first's (finished) URL
        while "url" not in seen:
            pass
        with httpx.Client(timeout=30) as http:
            r = http.post(seen["url"] + "/chat/completions", headers={"Authorization": f"Bearer {api_key}"}, json=GOOD)
            agents_log["over"] = (r.status_code, r.json())
        return 1.0

    play(actor, lambda **kw: (agent if "url" not in seen else later)(kw["base_url"], kw["api_key"]), n=2, concurrency=1)
    assert agents_log["over"][0] == 410 and agents_log["over"][1]["error"]["code"] == "episode_over"


def test_models_lists_the_served_model_and_needs_the_key(actor):
    log: dict = {}

    def agent(base_url, api_key):
        with httpx.Client(timeout=30) as http:
            log["ok"] = http.get(base_url + "/models", headers={"Authorization": f"Bearer {api_key}"})
            log["root"] = http.get(base_url.rsplit("/episodes/", 1)[0] + "/v1/models",
                                   headers={"Authorization": f"Bearer {api_key}"})  # fmt: skip
            log["nokey"] = http.get(base_url + "/models")
        return 1.0

    play(actor, agent)
    assert log["ok"].status_code == 200 and [m["id"] for m in log["ok"].json()["data"]] == ["actor"]
    assert log["root"].status_code == 200
    assert log["nokey"].status_code == 401 and json.loads(log["nokey"].text)["error"]["code"] == "unauthorized"


def test_a_prompt_past_the_models_context_is_a_400_and_changes_nothing(actor):
    log: dict = {}
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "extra": 1}
    cases = [("long", "/chat/completions", {"messages": [{"role": "user", "content": "a" * 3000}]}, {}),
             ("short", "/chat/completions", {**short, "return_token_ids": True}, {})]  # fmt: skip
    seqs, metrics = play(actor, probe(cases, log))
    assert log["long"][0] == 400 and error(log, "long")["code"] == "context_length_exceeded"
    assert "context of 128 tokens" in error(log, "long")["message"]
    assert log["short"][0] == 200 and metrics["forks"] == 0 and metrics["refused"] == 1
    prompt, response, _ = trajectory(seqs)
    assert prompt == log["short"][1]["prompt_token_ids"]
    assert response == log["short"][1]["choices"][0]["token_ids"]
