"""LoRA: adapters (peft) on a trained model's linear layers; only they (and a value head) train.

Applied first of all transforms (`flowrl.backends.local.parallelize.parallelize`): the adapters are
parameters of their decoder layer, which FSDP2 then shards with it. The torch engine does not split
adapters tensor-parallel (refused by name). Checkpoints hold the adapters (`ADAPTER_FILE`); weight
syncs and HF checkpoints take the merged weights (`merge_lora`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn

from flowrl.errors import BackendError
from flowrl.specs import LoraConfig

#: Where a LoRA-trained model's checkpoint keeps what trained (the adapters, and a value head).
ADAPTER_FILE = "adapter.safetensors"


def add_lora(module: nn.Module, lora: LoraConfig, seed: int, name: str = "") -> None:
    """Inject LoRA adapters (peft) into ``module``'s ``lora.target_modules`` linear layers, in place and
    seeded; afterwards only the adapters (and a `ValueModel`'s head) require gradients."""
    from peft import LoraConfig as PeftLora
    from peft import inject_adapter_in_model

    lm = getattr(module, "backbone", None) or module  # a `ValueModel`: its decoder
    present = {n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in lora.target_modules if t not in present]
    if missing:
        raise BackendError(
            f"model '{name}': train.lora.target_modules names {missing}, which it does not have; its linear "
            f"layers: {', '.join(sorted(present))}."
        )
    config = PeftLora(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )
    torch.manual_seed(seed)  # the adapters' A matrices are drawn (B starts at zero: no change at first)
    inject_adapter_in_model(config, lm)
    for key, param in module.named_parameters():
        param.requires_grad_(".lora_" in key or key.startswith("head."))


@contextlib.contextmanager
def adapters_off(module: nn.Module) -> Iterator[None]:
    """``module``'s LoRA adapters switched off for the duration: it computes as its base model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merge_lora(weights: Mapping[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """A LoRA model's state dict as the plain model's: every adapted weight W + scaling * B @ A under
    its own key, the adapters gone (what generation engines and HF checkpoints take)."""
    out = {}
    for key, value in weights.items():
        if ".lora_" in key:
            continue
        if key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = weights[f"{stem}.lora_A.default.weight"], weights[f"{stem}.lora_B.default.weight"]
            value = value + (scaling * (b.float() @ a.float())).to(value.dtype)
        out[key.replace(".base_layer.", ".")] = value
    return out


def check_split(lora: LoraConfig | None, tensor: int, name: str) -> None:
    """Refuse LoRA adapters on a model split tensor-parallel, naming how to plan it instead."""
    if lora is not None and tensor > 1:
        raise BackendError(
            f"model '{name}' trains LoRA adapters, which the torch engine does not split tensor-parallel "
            f"(its layout has tp {tensor}). Plan it with --require {name}.tp=1, or train it without LoRA "
            "(train.lora.rank=0)."
        )
