"""A lean decode step for Llama-family models: one new token per row against a KV cache.

transformers' forward is general (any mask, cache, attention kernel, output capture), and at one
token per row that generality is most of the time on CPU: a two-layer model spends ~4 ms a step in
per-op overhead for ~1 ms of matrix products. This step runs the same modules (projections, norms,
MLP, rotary embedding, LM head: called, not copied, so LoRA layers, autocast and any weight
update apply) around a cache that is written in place and an attention that reads grouped KV
heads without repeating them. It is the eager attention's arithmetic (scores scaled, masked,
softmax in float32, cast back), so greedy decoding matches transformers' token for token (tests).

Only architectures whose decoder layer is exactly pre-norm attention + pre-norm MLP with rotary
positions are taken (`LeanDecoder.of`); any other model decodes through its own forward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: model types whose decoder layer is x + attn(norm(x)); x + mlp(norm(x)), rotary on q and k, no
#: sliding window (checked per config), optional per-head q/k norms (qwen3)
LEAN_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}


def _plain_rms_norm(module: nn.Module) -> bool:
    """transformers' RMSNorm of these architectures: ``weight * x / rms(x)`` in float32, which
    `torch.nn.functional.rms_norm` computes in one kernel, bit for bit (tests)."""
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and not list(module.children())
    )


class LeanDecoder:
    """Decodes rows of ``model`` one token at a time from a prefilled cache (`start`), in place."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.body = model.model
        self.layers = list(self.body.layers[: model.config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.groups = attn.num_key_value_groups
        self.scaling = attn.scaling
        self.norm_eps = {id(m): float(m.variance_epsilon) for m in model.modules() if _plain_rms_norm(m)}
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.bias = torch.empty(0)
        self.length = 0

    @staticmethod
    def of(model: nn.Module) -> LeanDecoder | None:
        """A lean decoder for ``model``, or None where its architecture is not one this step reproduces."""
        config = getattr(model, "config", None)
        body = getattr(model, "model", None)
        if config is None or getattr(config, "model_type", None) not in LEAN_MODEL_TYPES or body is None:
            return None
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return None
        if not all(hasattr(body, part) for part in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return None
        if not hasattr(model, "lm_head") or type(model).__name__.startswith("Peft"):
            return None
        for layer in body.layers:
            attn = getattr(layer, "self_attn", None)
            if {name for name, _ in layer.named_children()} != _LAYER_PARTS or attn is None:
                return None
            parts = {name for name, _ in attn.named_children()}
            if not _ATTENTION_PARTS <= parts <= _ATTENTION_PARTS | {"q_norm", "k_norm"}:
                return None
            if not all(hasattr(attn, a) for a in ("head_dim", "num_key_value_groups", "scaling")):
                return None
        return LeanDecoder(model)

    def start(self, keys: list[Tensor], values: list[Tensor], mask: Tensor, reserve: int) -> None:
        """Take the prefilled cache (per layer [B, kv_heads, T, head_dim]) and the attention mask over its
        T positions ([B, T], 1 = attended), with room for ``reserve`` more tokens."""
        batch, _, length, _ = keys[0].shape
        self.keys, self.values = [], []
        for k, v in zip(keys, values, strict=True):
            kb = k.new_empty((batch, k.shape[1], length + reserve, k.shape[-1]))
            vb = v.new_empty((batch, v.shape[1], length + reserve, v.shape[-1]))
            kb[:, :, :length] = k
            vb[:, :, :length] = v
            self.keys.append(kb)
            self.values.append(vb)
        self.bias = keys[0].new_zeros((batch, 1, 1, length + reserve))
        self.bias[:, 0, 0, :length].masked_fill_(mask == 0, float("-inf"))
        self.length = length

    def keep(self, rows: Tensor) -> None:
        """Keep only ``rows`` of the batch (finished rows leave it)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.bias = self.bias[rows]

    def _norm(self, module: nn.Module, x: Tensor) -> Tensor:
        eps = self.norm_eps.get(id(module))
        if eps is None or x.dtype != torch.float32 or module.weight.dtype != torch.float32:
            return module(x)
        return torch.nn.functional.rms_norm(x, module.weight.shape, module.weight, eps)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits [B, vocab] after feeding ``tokens`` [B] at ``positions`` [B]."""
        n = self.length
        end = n + 1
        x = self.body.embed_tokens(tokens[:, None])  # [B, 1, H]
        cos, sin = self.body.rotary_emb(x, position_ids=positions[:, None])
        cos = cos[:, None]  # [B, 1, 1, D]: broadcast over heads
        # rotary: x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1) = roll(x) * (-1, 1)
        half = self.head_dim // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]
        bias = self.bias[..., :end]
        batch = tokens.shape[0]
        for layer, keys, values in zip(self.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn
            h = self._norm(layer.input_layernorm, x)
            q = attn.q_proj(h).view(batch, 1, -1, self.head_dim)
            k = attn.k_proj(h).view(batch, 1, -1, self.head_dim)
            v = attn.v_proj(h).view(batch, 1, -1, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
            heads = q.shape[2]
            qk = torch.cat((q, k), dim=2).transpose(1, 2)  # [B, heads + kv_heads, 1, D]
            qk = qk * cos + qk.roll(half, dims=-1) * signed
            q, k, v = qk[:, :heads], qk[:, heads:], v.transpose(1, 2)
            keys[:, :, n : n + 1] = k
            values[:, :, n : n + 1] = v
            kv_heads = keys.shape[1]
            grouped = q.reshape(batch, kv_heads, self.groups, self.head_dim)  # query heads by their KV head
            scores = torch.matmul(grouped, keys[:, :, :end].transpose(2, 3)) * self.scaling + bias
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(grouped.dtype)
            out = torch.matmul(weights, values[:, :, :end])  # [B, kv_heads, groups, D]
            x = x + attn.o_proj(out.reshape(batch, 1, -1))
            x = x + layer.mlp(self._norm(layer.post_attention_layernorm, x))
        self.length = end
        return self.model.lm_head(self._norm(self.body.norm, x))[:, -1]
