"""A calculator agent written with the plain `openai` client; it knows nothing of flowrl.

The task asks for a product ("37*58:"). The model may press the calculator's key: a turn that
starts with "=" gets the result back as a user message ("2146"), and the model answers in its next
turn. The agent scores the final answer itself: 1 for the exact product, partial credit per digit
in place. Any OpenAI-compatible server works: flowrl hands it the episode's ``base_url``.

    flowrl run graphs/agent_calculator.py        # the tiny model learns to use the key
"""

from __future__ import annotations

import re

from openai import OpenAI

_PRODUCT = re.compile(r"(\d+)\s*([*+-])\s*(\d+)")
#: one client for every episode, each with its own base URL (``with_options``): a new OpenAI() per
#: episode costs ~30 ms of setting up TLS, more than the tiny model's whole turn
_CLIENT = OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", max_retries=0)


def _value(question: str) -> str:
    match = _PRODUCT.search(question)
    if match is None:
        return "error"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


def score(answer: str, response: str) -> float:
    """1 for the exact answer, else 0.9 x the share of characters in place."""
    response = response.strip()
    if response == answer:
        return 1.0
    if not response:
        return 0.0
    same = sum(a == r for a, r in zip(answer, response))
    return 0.9 * same / max(len(answer), len(response))


def run(base_url: str, api_key: str, model: str, messages: list[dict], answer: str) -> float:
    client = _CLIENT.with_options(base_url=base_url, api_key=api_key)
    messages = list(messages)
    question = messages[-1]["content"]
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if not text.startswith("="):
            return score(answer, text)
        messages.append({"role": "user", "content": _value(question)})  # the calculator's display
    final = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    return score(answer, final.choices[0].message.content or "")
