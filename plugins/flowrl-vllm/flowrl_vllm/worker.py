"""Methods flowrl adds to vLLM's worker (``worker_extension_cls``), called through
``LLM.collective_rpc`` so that they work whether the engine runs in this process or in its own.

- ``flowrl_load_weights``: new weights into the running model, in place (the worker's
  ``reload_weights``, which repacks them as the initial load did; not ``model.load_weights``,
  which fails after vLLM's CPU weight repack).
- ``flowrl_export_weights``: what the engine samples with, by vLLM's own names (for checks).

In-process they take and return tensors. An engine in its own process gets a path instead: the
weights travel as a safetensors file in shared memory (vLLM's RPC decodes tensors in arguments
as plain lists, and a file is one copy, not a message per tensor).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def _read(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            yield name, f.get_tensor(name)


class FlowRLWorker:
    """Mixed into vLLM's worker class by vLLM (so ``self`` is the worker)."""

    def flowrl_load_weights(self: Any, weights: Mapping[str, torch.Tensor] | str) -> None:
        pairs = _read(weights) if isinstance(weights, str) else iter(weights.items())
        self.reload_weights(weights_iterator=pairs)

    def flowrl_export_weights(self: Any, path: str | None = None) -> dict[str, torch.Tensor] | None:
        model = self.model_runner.get_model()  # the raw model (on a GPU, out of its CUDA graph wrapper)
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
        if path is None:
            return state
        save_file(state, path)
        return None
