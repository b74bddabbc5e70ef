"""A model's shape: what the plan costs and the runtime checks a run builds (presets: `flowrl.planner.modelspec`).

Only the shape matters here (no weights are read): a Llama/Qwen2-style dense decoder with
grouped-query attention, a SwiGLU MLP (gate, up, down) and RMSNorm. `for_config` derives a run's
base model from its config: the HF ``config.json`` of its model folder, or the tiny model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from flowrl.contract.checked import CheckedSpec, Count, SpecFieldError
from flowrl.errors import ConfigError
from flowrl.specs import TinyModelConfig, model_folders, read_document


class ModelSpec(CheckedSpec, kw_only=True):
    name: str
    layers: Count
    hidden: Count
    heads: Count
    kv_heads: Count
    intermediate: Count
    vocab: Count
    tied_embeddings: bool = False
    head_dim: Count | None = None  # None: hidden // heads
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    # a scalar (value) head, hidden -> 1, in place of the LM head: a critic's, reward or cost model's
    # (`flowrl.backends.local.models.ValueModel`: the decoder, its input embedding and final norm, no LM
    # head, one output per token). The planner sets it for the graph's models of those roles (`with_head`).
    scalar_head: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heads % self.kv_heads:
            raise SpecFieldError(f"ModelSpec field 'kv_heads' ({self.kv_heads}) must divide 'heads' ({self.heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise SpecFieldError(
                f"ModelSpec field 'heads' ({self.heads}) must divide 'hidden' ({self.hidden}) unless "
                "'head_dim' is given"
            )

    @property
    def dim_per_head(self) -> int:
        """``head_dim``, or ``hidden // heads`` when unset."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    def layer_parameters(self) -> int:
        """One decoder layer: q, k, v, o projections (+ q/k/v biases), gate/up/down, 2 RMSNorms."""
        h, hd = self.hidden, self.dim_per_head
        q, kv = self.heads * hd, self.kv_heads * hd
        attention = h * q + 2 * h * kv + q * h
        bias = q + 2 * kv if self.qkv_bias else 0
        return attention + bias + 3 * h * self.intermediate + 2 * h

    @property
    def outputs(self) -> int:
        """What the head computes per token: the vocabulary's logits, or one value (`scalar_head`)."""
        return 1 if self.scalar_head else self.vocab

    def head_parameters(self) -> int:
        """The output head: the LM head (vocabulary x hidden; the input embedding's when tied), or a
        scalar head's weight and bias."""
        return self.hidden + 1 if self.scalar_head else self.vocab * self.hidden

    def with_head(self, scalar: bool) -> ModelSpec:
        """This shape with a scalar head (``scalar``) or an LM head."""
        return self if scalar == self.scalar_head else msgspec.structs.replace(self, scalar_head=scalar)

    def lora_parameters(self, rank: int, targets: Iterable[str]) -> int:
        """LoRA adapters of ``rank`` on ``targets``: rank x (inputs + outputs) for each adapted projection
        of each decoder layer (q_proj ... down_proj), and once for the model's ``lm_head`` (none with a
        scalar head) or ``embed_tokens`` (vocabulary x hidden)."""
        h, hd, i = self.hidden, self.dim_per_head, self.intermediate
        q, kv = self.heads * hd, self.kv_heads * hd
        shapes = {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }  # fmt: skip
        once = {"embed_tokens": (self.vocab, h), **({} if self.scalar_head else {"lm_head": (h, self.vocab)})}
        layers = self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)
        return layers + sum(rank * sum(once[t]) for t in targets if t in once)

    def parameters(self) -> int:
        """Exact count: embeddings V*H (+ lm_head V*H unless tied, or a scalar head H + 1) + layers +
        final norm H."""
        shared = self.tied_embeddings and not self.scalar_head  # the LM head is the input embedding
        head = 0 if shared else self.head_parameters()
        return self.vocab * self.hidden + head + self.layers * self.layer_parameters() + self.hidden

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs for one token attending to ``context`` tokens.

        ``2 * N + 4 * layers * context * heads * head_dim`` where N = ``parameters()`` less the
        input embedding (a lookup, no FLOPs) but with the lm_head counted once even when tied
        (its matmul still runs; a scalar head's hidden + 1 instead): every weight costs a
        multiply-add per token. The second term is
        QK^T and attention-times-V (2 FLOPs per multiply-add each). ``context`` is the number of
        keys a token sees: for a causal pass over a sequence of length L, pass the average
        (about L / 2); for decoding, the current length. Backward is about 2x forward.
        """
        if context < 0:
            raise ConfigError(f"flops_per_token: context must be >= 0, got {context}.")
        matmul_params = self.layers * self.layer_parameters() + self.hidden + self.head_parameters()
        attention = 4 * self.layers * context * self.heads * self.dim_per_head
        return float(2 * matmul_params + attention)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token: ``2 (K and V) * layers * kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.layers * self.kv_heads * self.dim_per_head * dtype_bytes


def check_model_keys(keys: Iterable[str], models: Mapping[str, str], what: str) -> None:
    """Refuse a per-model key that names neither a graph model nor one of the graph's roles.
    ``models``: graph model name -> role; ``what``: the flag or field that gave the keys."""
    roles = set(models.values())
    unknown = [k for k in keys if k not in models and k not in roles]
    if unknown:
        raise ConfigError(
            f"{what} names {', '.join(repr(k) for k in unknown)}, which is neither a model of this graph "
            f"({', '.join(models)}) nor one of its roles ({', '.join(sorted(roles))})."
        )


_HF_REQUIRED = {
    "num_hidden_layers": "layers",
    "hidden_size": "hidden",
    "num_attention_heads": "heads",
    "intermediate_size": "intermediate",
    "vocab_size": "vocab",
}


def base_folder(model: str | None) -> str | None:
    """The folder of a run's base model from config field ``model``: a single folder, else the
    ``actor=`` entry, else the bare (default) entry; None (the fresh tiny model) when neither is
    given (``reward=RM`` alone: the actor is the tiny model). The planner costs every model of a
    run with this shape."""
    default, named = model_folders(model)
    return named.get("actor", default)


def from_model_dir(path: str) -> ModelSpec:
    """The shape of the HF model in directory ``path`` (its ``config.json``; no weights are read)."""
    check_model_dir(path)
    return _from_hf_config(Path(path) / "config.json")


#: The largest model-folder file read before parsing: a JSON config (config.json, generation_config.json,
#: tokenizer_config.json, special_tokens_map.json, a chat template) of at most 16 MiB; a tokenizer's vocabulary
#: (tokenizer.json, vocab.json, merges.txt, tokenizer.model, ...) of at most 256 MiB (the largest real ones are
#: tens of MiB). A larger one is refused naming it before anything reads it.
MAX_CONFIG_FILE_BYTES = 16 << 20
MAX_VOCAB_FILE_BYTES = 256 << 20
_CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model")


def check_model_dir(path: str) -> None:
    """Refuse, saying how to fix it, a ``--model`` that is not an HF model directory, or one holding a
    config or tokenizer file over `MAX_CONFIG_FILE_BYTES` / `MAX_VOCAB_FILE_BYTES` (or one that is no
    regular file)."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(
            f"model directory '{path}' does not exist. Pass --model with a directory holding an HF "
            "config.json, weights and a tokenizer "
            "(e.g. a runs/<name>/checkpoint from an earlier run)."
        )
    if not (p / "config.json").is_file():
        raise ConfigError(f"model directory '{path}' has no config.json; it is not an HF-format model.")
    for names, cap in ((_CONFIG_FILES, MAX_CONFIG_FILE_BYTES), (_VOCAB_FILES, MAX_VOCAB_FILE_BYTES)):
        for name in names:
            file = p / name
            if not file.exists():
                continue
            if not file.is_file():
                raise ConfigError(f"model directory '{path}': '{name}' is not a regular file (a folder or a device?).")
            size = file.stat().st_size
            if size > cap:
                raise ConfigError(
                    f"model directory '{path}': '{name}' is {size} bytes, more than flowrl reads for it "
                    f"({cap} bytes); it is not a model's {name} (damaged or replaced?)."
                )


def for_config(model: str | None, tiny: TinyModelConfig, tokenizer_vocab: int) -> ModelSpec:
    """The base model of a run: the HF model directory ``model``, or the tiny model built from scratch.
    Per-model folders (``actor=DIR,reward=DIR2``: `flowrl.specs.model_folders`) are each checked;
    the shape is `base_folder`'s."""
    default, named = model_folders(model)
    entries = {**({"(default)": default} if named and default is not None else {}), **named}
    for key, folder in entries.items():
        try:
            check_model_dir(folder)
        except ConfigError as exc:
            raise ConfigError(f"config field 'model', entry '{key}': {exc}") from None
    base = base_folder(model)
    return from_model_dir(base) if base is not None else from_tiny(tiny, tokenizer_vocab)


def from_tiny(cfg: TinyModelConfig, tokenizer_vocab: int) -> ModelSpec:
    """The shape of the tiny Llama built from scratch when no model directory is given."""
    vocab = cfg.vocab_size or tokenizer_vocab
    if vocab < tokenizer_vocab:
        raise ConfigError(
            f"config field 'tiny_model.vocab_size' ({vocab}) is smaller than the tokenizer ({tokenizer_vocab} tokens)."
        )
    try:
        return ModelSpec(
            name="tiny-llama",
            layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            intermediate=cfg.intermediate_size,
            vocab=vocab,
        )
    except ConfigError as exc:
        raise ConfigError(f"config field 'tiny_model': {exc}") from None


def _from_hf_config(path: Path) -> ModelSpec:
    if path.suffix.lower() != ".json":
        raise ConfigError(f"model config '{path}' must be a JSON file (an HF config.json).")
    data = read_document(path)
    what = f"model config '{path}'"
    if "num_hidden_layers" not in data and isinstance(data.get("text_config"), dict):
        data = {**data["text_config"], "model_type": data["text_config"].get("model_type", data.get("model_type"))}
    fields: dict[str, Any] = {}
    for key, field in _HF_REQUIRED.items():
        if data.get(key) is None:
            raise ConfigError(f"{what}: missing required field '{key}' (needed for the model's {field}).")
        fields[field] = _int(data[key], key, what)
    kv = data.get("num_key_value_heads")
    fields["kv_heads"] = fields["heads"] if kv is None else _int(kv, "num_key_value_heads", what)
    head_dim = data.get("head_dim")
    fields["head_dim"] = None if head_dim is None else _int(head_dim, "head_dim", what)
    tied = data.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ConfigError(f"{what}: field 'tie_word_embeddings' must be true or false, got {tied!r}.")
    model_type = str(data.get("model_type") or "")
    fields.update(tied_embeddings=tied, qkv_bias=model_type.lower().startswith("qwen2"))
    fields["name"] = path.parent.name or model_type or path.stem
    try:
        return ModelSpec(**fields)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def _int(value: Any, key: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what}: field '{key}' must be an integer, got {value!r}.")
    return value
