"""How the training engine computes (dtype, attention, recomputation), resolved from the config and
the hardware, and the memory numerics that follow (read by `resolve`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from flowrl.contract.hardware import HardwareSpec, is_cpu
from flowrl.contract.resolved import EngineNumerics
from flowrl.errors import ConfigError
from flowrl.planner import memory as mem
from flowrl.specs import AUTO, TrainConfig

if TYPE_CHECKING:
    pass


#: Parameters from which a CPU with native bfloat16 (avx512_bf16 / AMX) trains faster in bfloat16: measured
#: here (fwd+bwd of 16 x 112 tokens): 4.8 M parameters 2.2x, 25 M 2.4x, SmolLM2-135M
#: 2.0x faster. Below it stay the tiny models the toy tasks train from scratch: exact, and overhead-bound.
CPU_BF16_PARAMETERS = 10_000_000


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this machine's CPU computes bfloat16 natively (avx512_bf16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_numerics(train: TrainConfig, hw: HardwareSpec, parameters: int = 0) -> EngineNumerics:
    """How the training engine computes: ``train.dtype`` / ``train.attention``, ``auto`` taking bfloat16
    and SDPA on a GPU; on a CPU eager attention (faster than SDPA here, padded batches included) and
    float32, or bfloat16 for a model of ``CPU_BF16_PARAMETERS`` or more on a CPU with native bfloat16
    (``parameters``: the largest graph model's); flash attention is refused on a CPU."""
    cpu = is_cpu(hw)
    if cpu and train.attention == "flash_attention_2":
        raise ConfigError(
            f"train.attention=flash_attention_2 needs a CUDA GPU (with the flash-attn package); the plan's device "
            f"is a CPU ('{hw.name}'). Use train.attention=sdpa or eager."
        )
    half = not cpu or (parameters >= CPU_BF16_PARAMETERS and cpu_has_bf16())
    dtype = train.dtype if train.dtype != AUTO else ("bfloat16" if half else "float32")
    attention = train.attention if train.attention != AUTO else ("eager" if cpu else "sdpa")
    return EngineNumerics(dtype=dtype, attention=attention, recompute=train.recompute)


def engine_memory(base: mem.Numerics, numerics: EngineNumerics) -> mem.Numerics:
    """The executor's memory numerics (``base``: float32 master weights, gradients and AdamW states) for
    an engine computing as ``numerics``: bfloat16 computes with a bfloat16 copy of the float32 weights
    (2 bytes a parameter while the model computes: autocast's casts, FSDP2's gathered parameters) and
    keeps 2-byte activations; recomputation keeps only each layer's input; eager attention keeps the
    heads x sequence scores. Checked against what runs by benchmarks/memory_fidelity.py."""
    half = numerics.dtype == "bfloat16"
    return msgspec.structs.replace(
        base,
        compute_copy_bytes=2 if half and base.weight_bytes >= 4 else 0,
        activation_bytes=2 if half else max(base.activation_bytes, 4),
        recompute=numerics.recompute,
        eager_attention=numerics.attention == "eager",
    )
