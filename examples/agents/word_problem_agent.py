"""A word-problem agent with a second try, written with the plain `openai` client.

It asks the question (the task's chat messages, system prompt included); it reads the final number
of the reply ("... The answer is 42."); when that is wrong it says so and asks again, once. Its
reward is 1 for a right final answer (0.5 when only the second try was), else 0. Nothing here knows
flowrl: any OpenAI-compatible server could answer it.

    python benchmarks/agent_real_model.py      # SmolLM2-135M-Instruct trained through this agent
"""

from __future__ import annotations

import re

from openai import OpenAI

_CLIENT = OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", max_retries=0)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def run(base_url: str, api_key: str, model: str, messages: list[dict], answer: str, max_tokens: int = 48) -> float:
    client = _CLIENT.with_options(base_url=base_url, api_key=api_key)
    messages = list(messages)
    for attempt in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
        text = reply.choices[0].message.content or ""
        if final_number(text) == answer.strip():
            return 1.0 if attempt == 0 else 0.5
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "That is not right. Check the numbers and try again."},
        ]
    return 0.0
