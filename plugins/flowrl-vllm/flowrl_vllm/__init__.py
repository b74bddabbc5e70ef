"""flowrl's vLLM generation engine (`--set generation.engine=vllm`).

vLLM loads only when an engine is built, so installing this plugin costs `flowrl` nothing at
start-up. See flowrl_vllm/engine.py.
"""

from __future__ import annotations

from typing import Any

from flowrl.plugins.hookspecs import hookimpl


@hookimpl
def register_generation_engines(register: Any) -> None:
    from flowrl_vllm.engine import VLLMEngine

    register(
        "vllm",
        VLLMEngine,
        description="vLLM: batched sampling with log-probs, in-place weight updates, resumable rows",
    )
