"""Offload: a trainable model's optimizer states in host memory between steps.

Sharded by FSDP2, the shards themselves (parameters, gradients and optimizer states) live on the host
and the optimizer steps there (`fsdp_policy`). In one process on an accelerator, the states move to
the device for each step and back after it (`host_step`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def fsdp_policy(device: torch.device) -> Any:
    """FSDP2's host-offload policy (pinned host memory for a CUDA device)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def move_states(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every tensor of ``optimizer``'s state onto ``device`` (the step counts stay where they are)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def host_step(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """``optimizer``'s step with its states brought from host memory to ``device`` and sent back."""
    move_states(optimizer, device)
    optimizer.step()
    move_states(optimizer, torch.device("cpu"))
