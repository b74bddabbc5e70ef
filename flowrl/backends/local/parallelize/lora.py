"""LoRA: adapters (peft) on a trained model's linear layers; only they (and a value head) train.

Applied first of all transforms (`flowrl.backends.local.parallelize.parallelize`): the adapters are
parameters of their decoder layer, which FSDP2 then shards with it. The torch engine does not split
adapters tensor-parallel (refused by name). Checkpoints hold the adapters (`ADAPTER_FILE`); weight
syncs and HF checkpoints take the merged weights (`merge_lora`, float32).

A model computing in bfloat16 under autocast (one process, not FSDP2) pays for LoRA where a full
fine-tune does not: autocast keeps a weight's bfloat16 cast for the whole pass only for a weight that
requires grad, so a frozen base is cast again at every call -- at every decode step of a generation.
Two remedies: the adapted layers' frozen base weights are stored in bfloat16 (`store_base`, what
autocast computes them in: the same logits), and generation samples from a `MergedCopy` (the
adapters merged into bfloat16 linear weights, refreshed only when the weights changed).
"""

from __future__ import annotations

import contextlib
import copy
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
    """A LoRA model's state dict as the plain model's: every adapted weight W + scaling * B @ A (float32,
    whatever the base is stored in: `store_base`) under its own key, the adapters gone (what generation
    engines and HF checkpoints take)."""
    out = {}
    for key, value in weights.items():
        if ".lora_" in key:
            continue
        if key.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = weights[f"{stem}.lora_A.default.weight"], weights[f"{stem}.lora_B.default.weight"]
            value = merged_weight(value, a, b, scaling)
        elif key.endswith(".base_layer.bias"):
            value = value.float()
        out[key.replace(".base_layer.", ".")] = value
    return out


def merged_weight(base: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """One adapted layer's merged weight in float32: W + scaling * B @ A (outside autocast, whatever pass
    it is called in)."""
    if scaling == 0.0:  # the base alone (a reference's weights)
        return base.float()
    with torch.autocast(base.device.type, enabled=False):
        return base.float() + scaling * (b.float() @ a.float())


def _adapted(module: nn.Module) -> list[nn.Module]:
    """``module``'s LoRA-adapted linear layers (peft's)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


def store_base(module: nn.Module, dtype: torch.dtype) -> None:
    """Store the adapted layers' frozen base weights in ``dtype``: for a model whose passes all run under
    ``dtype`` autocast, which computes those linear layers in ``dtype`` anyway (the same logits, half the
    memory, no cast per pass). `merge_lora` still exports float32; not for FSDP2 (its policy casts)."""
    for layer in _adapted(module):
        layer.get_base_layer().to(dtype)


class MergedCopy:
    """A LoRA causal LM to sample from: the module's structure without adapters, its linear layers'
    weights merged (W + scaling * B @ A) and stored in ``dtype`` (what autocast computes them in), its
    other tensors (embeddings, norms, rotary tables) the module's own, shared. A frozen LoRA model under
    autocast casts every weight at every decode step; this copy casts none. `refresh` merges again only
    when the weights changed since, as the caller's ``key`` says (torch's per-tensor version counters do
    not: the fused AdamW kernel leaves them). It samples under the same autocast as the module: while the
    adapters are zero its logits are the module's exactly; once trained, they differ by the rounding of
    the merged weights to ``dtype``."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        shared = {id(t): t for t in (*module.parameters(), *module.buffers())}
        self.module = copy.deepcopy(module, shared)  # the structure; every tensor is the module's
        # (half, base layer, A, B): A and B None for a linear layer without adapters (an LM head)
        self.pairs: list[tuple[nn.Linear, nn.Linear, nn.Linear | None, nn.Linear | None]] = []
        originals = dict(module.named_modules())

        def replace(parent: nn.Module, prefix: str) -> None:
            for name, child in list(parent.named_children()):
                path = f"{prefix}{name}"
                if isinstance(child, (BaseTunerLayer, nn.Linear)):
                    source = originals[path]
                    base = source.get_base_layer() if isinstance(source, BaseTunerLayer) else source
                    half = nn.Linear(
                        base.in_features, base.out_features, bias=base.bias is not None, device="meta", dtype=dtype
                    ).to_empty(device=base.weight.device)
                    half.requires_grad_(False)
                    ab = (source.lora_A["default"], source.lora_B["default"]) if base is not source else (None, None)
                    self.pairs.append((half, base, *ab))
                    parent._modules[name] = half
                else:
                    replace(child, f"{path}.")

        replace(self.module, "")
        self.module.eval()  # (the shared tensors keep their own requires_grad)
        self.seen: object = None  # the key of the weights merged last (None: none yet)

    @torch.no_grad()
    def refresh(self, scaling: float, key: object) -> nn.Module:
        """The copy, its linear weights merged from the module's current ones when ``key`` (which names the
        module's weights: changes whenever they do) is not the key of the last merge."""
        if key is None or key != self.seen:
            self._merge(scaling)
            self.seen = key
        return self.module

    def _merge(self, scaling: float) -> None:
        for half, base, a, b in self.pairs:
            if a is None or b is None:
                half.weight.copy_(base.weight)
            else:
                half.weight.copy_(merged_weight(base.weight, a.weight, b.weight, scaling))
            if base.bias is not None:
                half.bias.copy_(base.bias)


def check_split(lora: LoraConfig | None, tensor: int, name: str) -> None:
    """Refuse LoRA adapters on a model split tensor-parallel, naming how to plan it instead."""
    if lora is not None and tensor > 1:
        raise BackendError(
            f"model '{name}' trains LoRA adapters, which the torch engine does not split tensor-parallel "
            f"(its layout has tp {tensor}). Plan it with --require {name}.tp=1, or train it without LoRA "
            "(train.lora.rank=0)."
        )
