"""flowrl's verifiers harness: the policy's side of a verifiers (0.4) rollout, played in-process.

A verifiers harness is the program that answers a task through the rollout's interception endpoint (which
records the trace the rewards read). Its built-in ones (``null``, ``bash``, ...) install and run a program
with ``uv`` -- a download -- so flowrl plays every seat with this one instead: a chat turn, one request a
segment, through the interception endpoint with the OpenAI client; the environment drives further turns
(``resume``: the whole conversation so far). Tool servers (MCP) are not handed to the model.

Imported only by `flowrl.agents.verifiers_env` (it imports verifiers), and registered under the flat module
name :data:`HARNESS_ID`, which is how verifiers finds a harness (``harness.id``).
"""

from __future__ import annotations

import sys
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

#: the ``harness.id`` verifiers imports this module by (a flat name: verifiers looks ids up as modules)
HARNESS_ID = "flowrl_chat_harness"


class FlowRLChatConfig(vf.HarnessConfig):
    pass


class FlowRLChatHarness(vf.Harness[FlowRLChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        import httpx
        from openai import AsyncOpenAI

        if mcp_urls:
            raise vf.HarnessError(
                f"the task offers tool servers ({', '.join(mcp_urls)}), which flowrl's chat harness does not hand "
                "to the model"
            )
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        # the interception endpoint is a loopback http server: no TLS, so no CA bundle to load (~25 ms of CPU
        # per client, which was a fifth of a tiny model's episode)
        http = httpx.AsyncClient(verify=False, timeout=None) if endpoint.startswith("http://") else None
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)  # the trace records it
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["FlowRLChatHarness"]

sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
