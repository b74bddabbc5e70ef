"""Tool calling in the chat template's format: the tool schema in the prompt, tool calls parsed from
a model turn, tool results rendered back as the template writes them.

- `with_tools`: a templated prompt re-rendered from its messages with ``tools=`` (transformers'
  ``apply_chat_template``), so the model reads the schema as its template shows it. A template that
  does not render tools is refused: the model would be asked to call tools it never saw.
- `parse_tool_calls`: the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of a
  turn (the Hermes format Qwen2.5, SmolLM3 and others use); a block that is not such JSON counts as bad,
  as does one nested deeper than `flowrl.tasks.bounded.MAX_JSON_DEPTH` (the model's text is untrusted).
- `tool_text`: what the template writes between the model's turn and its next one for ``role: tool``
  messages: the end of the assistant turn, the tool turn(s), and the next assistant header.
- Every render goes through `flowrl.tasks.bounded.render_chat`: transformers' variables, within a time
  and size limit; a template that fails or passes a limit is a ConfigError naming it.
- `ToolEnvironment`: an environment whose tools are Python functions (schemas from their signatures
  and docstrings, `transformers.utils.get_json_schema`); a turn's calls run in order, and a turn
  without a call is the final answer, which ends the episode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from flowrl.contract.data import Prompt, ToolCall, Turn
from flowrl.errors import ConfigError
from flowrl.tasks import bounded

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MARK = "\x00flowrl-turn\x00"  # stands for a turn's content while the template renders around it


def parse_tool_calls(text: str) -> tuple[tuple[ToolCall, ...], int]:
    """The tool calls in ``text`` and how many ``<tool_call>`` blocks were not a valid call (not JSON,
    or nested past `flowrl.tasks.bounded.MAX_JSON_DEPTH`)."""
    calls, bad = [], 0
    for body in _CALL.findall(text):
        try:
            data = bounded.loads(body)
        except ValueError:
            bad += 1
            continue
        args = data.get("arguments", {}) if isinstance(data, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = bounded.loads(args)
            except ValueError:
                args = None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(args, dict):
            bad += 1
            continue
        calls.append(ToolCall(name=data["name"], arguments=args))
    return tuple(calls), bad


def _render(tokenizer: Any, template: str | None, messages: Sequence[dict[str, Any]], where: str, **kw: Any) -> str:
    """``apply_chat_template(messages, tokenize=False, ...)`` within the limits (the tokenizer's own
    template when ``template`` is None)."""
    template = template or resolve_template(tokenizer)
    if template is None:
        raise ConfigError(f"{where}: the tokenizer has no chat template; give one with data.chat_template=FILE.")
    return bounded.render_chat(tokenizer, template, messages, where=where, **kw)


def resolve_template(tokenizer: Any) -> str | None:
    """The tokenizer's chat template (its default one, when it has several named ones), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template else None


def with_tools(prompt: Prompt, tools: Sequence[dict[str, Any]], tokenizer: Any, template: str | None) -> Prompt:
    """``prompt`` rendered again from its chat messages with the tools' schemas."""
    if not prompt.messages:
        raise ConfigError(
            f"the environment offers tools, but prompt {prompt.text[:60]!r} was not rendered by a chat template: "
            "tools need chat prompts (data.chat_template, or a model whose tokenizer has one)."
        )
    where = "the prompt with the environment's tools"
    text = _render(tokenizer, template, prompt.messages, where, tools=list(tools), add_generation_prompt=True)
    if text == _render(tokenizer, template, prompt.messages, where, add_generation_prompt=True):
        raise ConfigError(
            "the chat template does not render tools (apply_chat_template(tools=...) wrote the same prompt): give a "
            "template that does with data.chat_template=FILE (examples/templates/chatml_tools.jinja is one)."
        )
    return Prompt(text=text, answer=prompt.answer, meta=prompt.meta, templated=True, messages=prompt.messages)


def tool_text(tokenizer: Any, template: str | None, results: Sequence[str], ended_at_eos: bool) -> str:
    """The text the chat template writes after an assistant turn for tool messages ``results``, up to
    the next assistant turn's header. The turn's own EOS (when it ended at one) is not repeated."""
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
    where = "the tool results"
    before = _render(tokenizer, template, base, where)
    after = _render(
        tokenizer,
        template,
        [*base, *({"role": "tool", "content": r} for r in results)],
        where,
        add_generation_prompt=True,
    )
    if not after.startswith(before) or _MARK not in before:
        raise ConfigError(
            "the chat template renders an earlier turn differently once tool turns follow it; "
            "tool results cannot be appended to the response"
        )
    closing = before[before.rindex(_MARK) + len(_MARK) :]  # what ends the assistant turn
    eos = getattr(tokenizer, "eos_token", None)
    if ended_at_eos and eos and closing.startswith(eos):
        closing = closing[len(eos) :]
    return closing + after[len(before) :]


class ToolEnvironment:
    """Tools as Python functions: ``ToolEnvironment([multiply, add])``. Each episode's model turn has
    its tool calls run in order; each result (``json.dumps`` of what the function returned, or
    ``error: ...``) goes back as a tool message. A turn with no call ends the episode. ``penalty``: the
    turn reward of a turn whose call is malformed or fails."""

    def __init__(self, functions: Sequence[Callable[..., Any]], penalty: float = 0.0) -> None:
        from transformers.utils import get_json_schema

        self.functions = {fn.__name__: fn for fn in functions}
        self.tools = [get_json_schema(fn) for fn in functions]
        self.penalty = penalty

    def episode(self, prompt: Prompt) -> _ToolEpisode:
        return _ToolEpisode(self)


class _ToolEpisode:
    def __init__(self, env: ToolEnvironment) -> None:
        self.env = env

    def step(self, turn: Turn) -> Any:
        from flowrl.tasks.environments import Step

        _, bad = parse_tool_calls(turn.text)
        if not turn.tool_calls:
            return Step(done=True, reward=self.env.penalty if bad else 0.0)
        results, failed = [], bad
        for call in turn.tool_calls:
            fn = self.env.functions.get(call.name)
            if fn is None:
                results.append(f"error: no tool named {call.name!r}; tools: {', '.join(self.env.functions)}")
                failed += 1
                continue
            try:
                results.append(json.dumps(fn(**call.arguments)))
            except Exception as exc:  # the model's arguments: the error is its tool result
                results.append(f"error: {type(exc).__name__}: {exc}")
                failed += 1
        return Step(tool_results=tuple(results), reward=self.env.penalty if failed else 0.0)
