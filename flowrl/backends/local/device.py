"""The device the local engines run on, and what it offers the planner."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from flowrl.contract.checked import GiB
from flowrl.contract.hardware import NOMINAL, HardwareSpec, default_profile_path, load_hardware
from flowrl.errors import PlanError
from flowrl.specs import RunConfig


def resolve_device(requested: str) -> str:
    """'cpu', 'cuda', 'cuda:N' or 'auto' -> a torch device name this machine has."""
    import torch

    device = requested
    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = "cuda:0"
    if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise PlanError(
            f"config field 'device' is {requested!r}; the local engines run on 'cpu', 'cuda', 'cuda:N' or 'auto'."
        )
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise PlanError(
                f"config field 'device' is {requested!r} but torch sees no CUDA device here. Use --set device=cpu."
            )
        if int(device[5:]) >= torch.cuda.device_count():
            raise PlanError(
                f"config field 'device' is {requested!r} but torch sees {torch.cuda.device_count()} CUDA device(s)."
            )
    return device


def device_capacity(device: str) -> int:
    """Bytes this process may use on ``device`` (CPU: MemAvailable; CUDA: free memory)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine(cfg: RunConfig) -> HardwareSpec:
    """This machine's device as the planner sees it: `flowrl profile`'s measurements when it
    has run (else nominal speeds), with the memory the device has free now or the configured
    limit."""
    device = resolve_device(cfg.device)
    # free memory, rounded down to 1/4 GiB so that planning twice gives the same plan (and id)
    memory = (
        int(cfg.memory_limit_gib * GiB) if cfg.memory_limit_gib else device_capacity(device) // (GiB // 4) * (GiB // 4)
    )
    profile = default_profile_path()
    if device == "cpu" and profile.is_file():
        return msgspec.structs.replace(load_hardware(profile), memory_bytes=memory)
    return HardwareSpec(
        name=f"local-{device.replace(':', '')}{NOMINAL}",  # no profile has measured it
        peak_flops_bf16=1e11,
        peak_flops_fp32=1e11,
        memory_bytes=memory,
        memory_bandwidth=2e10,
        intra_node_bandwidth=2e10,
        inter_node_bandwidth=2e10,
        devices_per_node=1,
    )
