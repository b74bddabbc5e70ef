"""flowrl's vLLM generation engine (`--set generation.engine=vllm`).

vLLM (and torch) load only when an engine is built, so installing this plugin costs `flowrl` nothing
at start-up. See flowrl_vllm/engine.py.
"""

from __future__ import annotations

from typing import Any

from flowrl.contract import EngineCapabilities, hookimpl


def vllm_engine(ctx: Any) -> Any:
    """A `flowrl_vllm.engine.VLLMEngine` for ``ctx``; the engine module (torch, vLLM) loads on this first call."""
    from flowrl_vllm.engine import VLLMEngine

    return VLLMEngine(ctx)


@hookimpl
def register_generation_engines(register: Any) -> None:
    register(
        "vllm",
        vllm_engine,
        description="vLLM: batched sampling with log-probs, in-place weight updates, resumable rows",
        # tensor-parallel replicas on GPUs (SamplingSpec.tp); on a CPU each replica is one process
        capabilities=EngineCapabilities(model_parallel=True, captured_decode=True),  # CUDA graphs on GPUs
    )
