"""Model shapes for the planner's cost model: presets and HF ``config.json`` files.

Only the shape matters here (no weights are read): a Llama/Qwen2-style dense decoder with
grouped-query attention, a SwiGLU MLP (gate, up, down) and RMSNorm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrl.contract.model import ModelSpec, _from_hf_config, check_model_keys
from flowrl.errors import ConfigError, did_you_mean
from flowrl.specs import convert, named_entries, read_document


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv, intermediate=inter, vocab=vocab)


def _qwen(
    name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int, tied: bool = False
) -> ModelSpec:
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        intermediate=inter,
        vocab=vocab,
        tied_embeddings=tied,
        qkv_bias=True,
    )


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _llama("llama-7b", 32, 4096, 32, 32, 11008, 32000),
        _llama("llama-13b", 40, 5120, 40, 40, 13824, 32000),
        _llama("llama-34b", 48, 8192, 64, 8, 22016, 32000),
        _llama("llama-70b", 80, 8192, 64, 8, 28672, 32000),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
        _qwen("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, tied=True),
        _qwen("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, tied=True),
        _qwen("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, tied=True),
        _qwen("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064),
        _qwen("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064),
        _qwen("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064),
        _qwen("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064),
    )
}

# HF config.json key -> ModelSpec field; all required


def load_model_spec(text: str) -> ModelSpec:
    """A preset name (case-insensitive); an HF ``config.json`` or a directory holding one; or a
    YAML/TOML file of ModelSpec fields."""
    name = text.strip()
    preset = {k.lower(): v for k, v in MODEL_PRESETS.items()}.get(name.lower())
    if preset is not None:
        return preset
    path = Path(name).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"model directory '{path}' has no config.json.")
        return _from_hf_config(config)
    if path.is_file():
        if path.suffix.lower() in (".yaml", ".yml", ".toml"):
            return convert(read_document(path), ModelSpec, f"model spec file '{path}'")
        return _from_hf_config(path)
    looks_like_path = "/" in name or path.suffix.lower() in (".json", ".yaml", ".yml", ".toml")
    where = f" (no such file or directory '{path}')" if looks_like_path else ""
    raise ConfigError(
        f"model '{name}' is neither a preset nor a model directory or "
        f"config.json{where}.{did_you_mean(name, list(MODEL_PRESETS))} "
        f"Presets: {', '.join(MODEL_PRESETS)}."
    )


def load_model_specs(text: str) -> tuple[ModelSpec | None, dict[str, ModelSpec]]:
    """``--model`` for a cluster plan: one model for every role (``llama-7b``), or per role
    (``actor=llama-34b,reward=llama-7b``; a bare entry is the default), or a YAML/TOML file
    mapping roles to presets, config paths or ModelSpec fields. Returns (default, per role)."""
    name = text.strip()
    path = Path(name).expanduser()
    if "=" not in name:
        if path.is_file() and path.suffix.lower() in (".yaml", ".yml", ".toml"):
            data = read_document(path)
            # a per-role file maps roles to models; a file with any ModelSpec field is one model (typos named)
            if isinstance(data, dict) and data and not set(data) & set(ModelSpec.__struct_fields__):
                return _role_file(data, path)
        return load_model_spec(name), {}
    bare, named = named_entries(
        text.strip(), "--model", ("model", "role", "ROLE=MODEL", "actor=llama-34b,reward=llama-7b")
    )
    roles: dict[str, ModelSpec] = {}
    for key, value in named.items():
        try:
            roles[key] = load_model_spec(value)
        except ConfigError as exc:
            raise ConfigError(f"--model entry '{key}={value}': {exc}") from None
    return (load_model_spec(bare) if bare is not None else None), roles


def _role_file(data: dict[str, Any], path: Path) -> tuple[ModelSpec | None, dict[str, ModelSpec]]:
    """A per-role model file: ``role: preset-or-path`` or ``role: {ModelSpec fields}``; key ``default`` for the rest."""
    out: dict[str, ModelSpec] = {}
    for key, value in data.items():
        where = f"model file '{path}', entry '{key}'"
        if isinstance(value, dict):
            out[str(key)] = convert(value, ModelSpec, where)
        elif isinstance(value, str):
            base = Path(value).expanduser()
            target = value if base.is_absolute() or not (path.parent / base).exists() else str(path.parent / base)
            try:
                out[str(key)] = load_model_spec(target)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        else:
            raise ConfigError(f"{where}: give a preset name, a config path or ModelSpec fields, not {value!r}.")
    return out.pop("default", None), out


#: The key of ``ClusterTarget.models`` that holds ``--model``'s default entry until ``resolve`` expands it.
DEFAULT_ROLE = "*"


def role_models(given: dict[str, ModelSpec], models: dict[str, str]) -> dict[str, ModelSpec]:
    """Every graph model's shape from per-role ``given`` (keys: a graph model's name, a role, or
    ``DEFAULT_ROLE``). ``models``: graph model name -> role. A model not named takes its role's
    entry; a reference the actor's; a critic or cost model the reward model's; else the default, or
    without one the actor's."""
    check_model_keys([k for k in given if k != DEFAULT_ROLE], models, "--model")
    actors = [m for m, r in models.items() if r == "actor"]
    actor = next((given[k] for k in (*actors, "actor") if k in given), None)
    fallback = {"reference": actor, "critic": given.get("reward"), "cost": given.get("reward")}
    out: dict[str, ModelSpec] = {}
    for name, role in models.items():
        spec = given.get(name) or given.get(role) or fallback.get(role) or given.get(DEFAULT_ROLE) or actor
        if spec is None:
            raise ConfigError(
                f"--model gives no model for '{name}' (role {role}); name it ({name}=MODEL) or add a default "
                "model (e.g. --model llama-7b,reward=llama-1b)."
            )
        out[name] = spec
    return out
