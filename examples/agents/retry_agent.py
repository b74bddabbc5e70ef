"""An agent that gives the model a second try, written with the plain `openai` client.

It asks the task's question; when the answer is wrong it says so ("no, again") and asks once more.
The reward is the last answer's score: 1 for the exact answer, else partial credit per character in
place. Nothing here knows flowrl: any OpenAI-compatible server could answer.

    flowrl run graphs/grpo.py --set ... (see docs/guides/agents.md)
"""

from __future__ import annotations

from openai import OpenAI

_CLIENT = OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", max_retries=0)


def score(answer: str, response: str) -> float:
    response = response.strip()
    if response == answer:
        return 1.0
    if not response:
        return 0.0
    return 0.9 * sum(a == r for a, r in zip(answer, response)) / max(len(answer), len(response))


def run(base_url: str, api_key: str, model: str, messages: list[dict], answer: str, tries: int = 2) -> float:
    client = _CLIENT.with_options(base_url=base_url, api_key=api_key)
    messages = list(messages)
    reward = 0.0
    for _ in range(tries):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12)
        text = reply.choices[0].message.content or ""
        reward = score(answer, text)
        if reward == 1.0:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "no, again"}]
    return reward
