"""Memory arithmetic for one device: model states, activations, KV cache, logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GiB = 1024**3


def state_bytes(parameters: int, dtype: str, trainable: bool) -> int:
    """Weights; trainable adds fp32 grads and AdamW's two moments (4 + 4 + 4 bytes/param)."""
    weights = parameters * DTYPE_BYTES[dtype]
    return weights + (parameters * 12 if trainable else 0)


def activation_bytes(config: Any, rows: int, seq_len: int, *, training: bool, dtype: str = "float32") -> int:
    """Peak activations of one forward (kept for backward when training) plus fp32 logits.

    Per layer and token a decoder keeps roughly: attention inputs/outputs (~6 h), the MLP
    (~3 i), and attention scores (heads x seq for eager attention).
    """
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, vocab = config.num_attention_heads, config.vocab_size
    b = DTYPE_BYTES[dtype]
    per_token_layer = (6 * h + 3 * i + heads * seq_len) * b
    kept = per_token_layer * layers if training else per_token_layer * 2
    logits = vocab * 4 * (3 if training else 2)  # logits, log-softmax (and its grad)
    return rows * seq_len * (kept + logits)


def kv_cache_bytes(config: Any, rows: int, seq_len: int, dtype: str = "float32") -> int:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * rows * seq_len * DTYPE_BYTES[dtype]


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
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 100 else f"{n / 1024**2:.1f} MiB"
