"""Load or build HF-format causal LMs and tokenizers; the value-head wrapper.

Any HF causal LM directory works (transformers + safetensors). With no directory, flowrl
builds a tiny Llama with random weights and its character tokenizer: nothing is downloaded.
A folder whose config.json or tokenizer_config.json has an ``auto_map`` (Python of its own) loads
only with ``trust_remote_code`` (`RunConfig.trust_remote_code`, ``flowrl run --trust-remote-code``);
without it such a folder is refused naming the file, before transformers could ask on stdin.
A critic, reward or cost model (a scalar head) loads its trained head from a
sequence-classification checkpoint (``LlamaForSequenceClassification``, ``num_labels=1``: its
``score``) or from flowrl's own save of such a model; from a causal LM its head starts fresh.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.contract.model import check_model_dir
from flowrl.errors import BackendError
from flowrl.specs import TinyModelConfig, check_remote_code

VALUE_HEAD_FILE = "value_head.safetensors"


def _quiet_transformers() -> None:
    """flowrl draws its own progress bar; transformers' per-file bars would interleave with it."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


_quiet_transformers()


def load_tokenizer(path: str | None, trust_remote_code: bool = False) -> Any:
    """The tokenizer in ``path``, or flowrl's character tokenizer when ``path`` is None."""
    if path is None:
        from flowrl.tasks.tokenizer import build_tokenizer

        return build_tokenizer()
    check_model_dir(path)
    check_remote_code(path, trust_remote_code)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        hint = (
            " The folder has weights but no tokenizer files: it looks incomplete (a copy or a write that was "
            "interrupted?)."
            if not any((Path(path) / f).is_file() for f in files)
            else ""
        )
        raise BackendError(
            f"model directory '{path}' has no usable tokenizer ({type(exc).__name__}: {exc}).{hint} Save one with "
            f"tokenizer.save_pretrained('{path}')."
        ) from None
    length = getattr(tok, "model_max_length", None)
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 0):
        raise BackendError(
            f"'{path}/tokenizer_config.json', field 'model_max_length': {str(length)[:40]!r} is not a count of tokens."
        )
    tok.padding_side = "left"
    try:
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        eos = tok.eos_token_id
    except Exception as exc:  # a special token of another type, or one the vocabulary lacks
        raise BackendError(
            f"the tokenizer in '{path}' has unusable special tokens ({type(exc).__name__}: {str(exc)[:200]}); "
            "see its tokenizer_config.json and special_tokens_map.json."
        ) from None
    if eos is None:
        raise BackendError(f"the tokenizer in '{path}' has no EOS token; generation could never stop.")
    return tok


def tiny_llama_config(cfg: TinyModelConfig, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    vocab = cfg.vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise BackendError(f"tiny_model.vocab_size={vocab} is smaller than the tokenizer ({len(tokenizer)} tokens).")
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def model_config(path: str | None, tiny: TinyModelConfig, tokenizer: Any, trust_remote_code: bool = False) -> Any:
    """The HF config of the base model (read from ``config.json``; no weights are loaded)."""
    if path is None:
        return tiny_llama_config(tiny, tokenizer)
    check_model_dir(path)
    check_remote_code(path, trust_remote_code)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise BackendError(f"'{path}/config.json' is not a usable HF model config: {exc}") from None
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < len(tokenizer):
        raise BackendError(
            f"model directory '{path}': its config.json has vocab_size {vocab}, smaller than its tokenizer "
            f"({len(tokenizer)} tokens); the tokenizer belongs to another model."
        )
    return config


def build_causal_lm(path: str | None, config: Any, seed: int, trust_remote_code: bool = False) -> nn.Module:
    """Load weights from ``path``, or initialise ``config`` randomly (seeded)."""
    from transformers import AutoModelForCausalLM

    if path is None:
        torch.manual_seed(seed)
        # a folder's own config class exists here only if its folder was trusted (`model_config`)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", trust_remote_code=_custom(config))
    else:
        weights = (
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "pytorch_model.bin.index.json",
        )
        if not any((Path(path) / w).is_file() for w in weights):
            raise BackendError(
                f"model directory '{path}' has a config.json but no weights (model.safetensors); it looks incomplete "
                "(a copy or a checkpoint write that was interrupted?). flowrl's own checkpoints are written whole or "
                "not at all: use the newest runs/<name>/checkpoints/step-*/models/<model>."
            )
        check_remote_code(path, trust_remote_code)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path,
                local_files_only=True,
                dtype=torch.float32,
                attn_implementation="eager",
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
            )
        except Exception as exc:
            raise BackendError(f"could not load a causal LM from '{path}': {type(exc).__name__}: {exc}") from None
        # a weight the files lack would start random, silently: refused (a tied lm_head is not stored)
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            raise BackendError(
                f"model directory '{path}': its weights lack {len(missing)} tensor(s) the model needs "
                f"({', '.join(missing[:3])}); they would start random. The files are incomplete or of another model."
            )
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def _custom(config: Any) -> bool:
    """Whether HF config ``config`` is a model folder's own class (its ``auto_map``): a fresh model of
    it (a generation replica, a copy) is built from that folder's class, loaded when it was trusted."""
    return bool(getattr(config, "auto_map", None))


class ValueModel(nn.Module):
    """A causal LM backbone with a scalar head: per-token values (critic) or scores.

    ``lm``: any HF model whose ``base_model`` is the decoder (a causal LM, a sequence-classification
    model, or the bare decoder). ``head``: the head's trained weights (``weight`` [1, H], optional
    ``bias``); without them the head is fresh (drawn from torch's RNG). ``bias``: whether the head has a
    bias (a critic's does, zero where its weights have none; a reward or cost model's has none, as an
    HF classifier's ``score``, so that it saves as one: `save_classifier`), as it has where its weights do."""

    def __init__(self, lm: nn.Module, head: Mapping[str, Tensor] | None = None, bias: bool = True) -> None:
        super().__init__()
        self.backbone = lm.base_model
        self.config = lm.config
        hidden = lm.config.hidden_size
        self.head = nn.Linear(hidden, 1)  # with its bias either way: the same draws from torch's RNG
        nn.init.normal_(self.head.weight, std=1.0 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)
        if not (bias or (head is not None and "bias" in head)):
            self.head.bias = None
        if head is not None:
            weight = head["weight"].detach().to(self.head.weight.dtype)
            if tuple(weight.shape) != (1, hidden):
                raise BackendError(
                    f"a scalar head must be [1, {hidden}] (one label over the hidden size); got {list(weight.shape)}."
                )
            with torch.no_grad():
                self.head.weight.copy_(weight)
                if self.head.bias is not None and "bias" in head:
                    self.head.bias.copy_(head["bias"].detach().reshape(1))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor) -> Tensor:
        # no cache (it never generates): without a mask, position ids that restart mark packed rows
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.head(hidden).squeeze(-1)

    def save(self, path: Path, stamp: Mapping[str, str] | None = None, pad_token_id: int | None = None) -> None:
        """A head without a bias as an HF sequence-classification model (`save_classifier`); one with a
        bias (a critic's) as the backbone's HF directory plus the head in ``value_head.safetensors``
        (both what `build_model` loads back); ``stamp``: `save_hf`'s."""
        from safetensors.torch import save_file

        if self.head.bias is None:
            save_classifier(self, path, stamp, pad_token_id)
            return
        save_hf(self.backbone, path, stamp)
        head = {k: v.contiguous() for k, v in self.head.state_dict().items()}
        save_file(head, str(path / VALUE_HEAD_FILE), metadata={"format": "pt", **(stamp or {})})


#: A scalar head's weight as HF sequence-classification models name it (Llama, Qwen, Mistral, GPT-2: ``score``).
SCORE_WEIGHT = "score.weight"


def classifier_class(config: Any) -> tuple[str, str]:
    """The HF sequence-classification class of a decoder's config (``LlamaForSequenceClassification``) and
    the name its decoder has in it (its ``base_model_prefix``: ``model``); refused for a model type
    transformers has no such class for."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    cls = getattr(transformers, name, None) if name else None
    if cls is None or not getattr(cls, "base_model_prefix", ""):
        raise BackendError(
            f"transformers has no sequence-classification model for model type {getattr(config, 'model_type', None)!r}"
            "; a reward model of it cannot be saved as one."
        )
    return name, cls.base_model_prefix


def save_classifier(
    model: ValueModel, path: Path, stamp: Mapping[str, str] | None = None, pad_token_id: int | None = None
) -> None:
    """Write a scalar-head model without a head bias as an HF sequence-classification directory
    (``LlamaForSequenceClassification``, ``num_labels=1``): config.json with its ``architectures``,
    one label and the pad token id (HF's classifier scores each row at its last token that is not
    padding), and model.safetensors with the decoder under its prefix (``model.``) and the head as
    ``score.weight``. ``AutoModelForSequenceClassification.from_pretrained`` loads it as it is."""
    import copy

    from safetensors.torch import save_file

    name, prefix = classifier_class(model.config)
    config = copy.deepcopy(model.config)
    config.architectures = [name]
    config.num_labels = 1  # id2label {0: LABEL_0}
    if pad_token_id is not None:
        config.pad_token_id = int(pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    state, seen = {}, set()
    for key, value in model.backbone.state_dict().items():
        if value.data_ptr() in seen:  # a weight tied to an earlier one: stored once, as HF does
            continue
        seen.add(value.data_ptr())
        state[f"{prefix}.{key}"] = value.detach().to("cpu").contiguous()
    state[SCORE_WEIGHT] = model.head.weight.detach().to("cpu").contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt", **(stamp or {})})


def classifier_weights(tensors: Mapping[str, Tensor], config: Any) -> dict[str, Tensor]:
    """The `ValueModel` state dict of an HF sequence-classification model's tensors (`save_classifier`'s):
    ``model.X`` -> ``backbone.X``, ``score.weight`` -> ``head.weight``; other names kept as they are."""
    _, prefix = classifier_class(config)
    out = {}
    for key, value in tensors.items():
        if key == SCORE_WEIGHT:
            out["head.weight"] = value
        elif key.startswith(prefix + "."):
            out["backbone." + key[len(prefix) + 1 :]] = value
        else:
            out[key] = value
    return out


def scalar_checkpoint(path: str) -> str:
    """What kind of scalar-head checkpoint folder ``path`` holds: ``"flowrl"`` (a saved critic or
    reward model: the backbone and ``value_head.safetensors``), ``"classifier"`` (an HF
    sequence-classification model, e.g. ``LlamaForSequenceClassification`` with ``num_labels=1``:
    its ``score`` head, by ``config.architectures`` or a ``score.weight`` tensor), or ``"lm"`` (a
    causal LM: the head is fresh)."""
    import json

    folder = Path(path)
    if (folder / VALUE_HEAD_FILE).is_file():
        return "flowrl"
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        architectures = []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return "classifier"
    return "classifier" if "score.weight" in _weight_names(folder) else "lm"


def _weight_names(folder: Path) -> set[str]:
    """The tensor names of a folder's safetensors weights (one file or an index); empty for others."""
    import json

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return set(json.loads(index.read_text()).get("weight_map", {}))
        except (OSError, ValueError):
            return set()
    single = folder / "model.safetensors"
    if not single.is_file():
        return set()
    from safetensors import safe_open

    try:
        with safe_open(str(single), framework="pt") as fh:
            return set(fh.keys())
    except Exception:
        return set()


def build_model(
    path: str | None,
    config: Any,
    seed: int,
    scalar_head: bool,
    name: str = "",
    trust_remote_code: bool = False,
    head_bias: bool = True,
) -> nn.Module:
    """A graph model's module from folder ``path`` (None: fresh from ``config``, seeded): the causal
    LM, or for a scalar-head model (critic, reward, cost) a `ValueModel` whose head comes from the
    folder when it has one (`scalar_checkpoint`) and is fresh otherwise; ``head_bias``: with a bias (a critic's)."""
    if not scalar_head:
        return build_causal_lm(path, config, seed, trust_remote_code)
    kind = "lm" if path is None else scalar_checkpoint(path)
    if kind == "lm":
        if path is not None:
            print(
                f"flowrl: model '{name}': '{path}' is a causal LM without a scalar head; its value/score head starts "
                "fresh (random). Give a sequence-classification checkpoint (num_labels=1) to load a trained head.",
                file=sys.stderr,
                flush=True,
            )
        return ValueModel(build_causal_lm(path, config, seed, trust_remote_code), bias=head_bias)
    assert path is not None
    check_remote_code(path, trust_remote_code)
    from transformers import AutoModel, AutoModelForSequenceClassification

    if kind == "flowrl":  # flowrl's own save: the bare decoder and value_head.safetensors
        from safetensors.torch import load_file

        backbone = _pretrained(AutoModel, path, "a scalar-head model", trust_remote_code)
        try:
            head = load_file(str(Path(path) / VALUE_HEAD_FILE))
        except Exception as exc:
            raise BackendError(f"'{path}/{VALUE_HEAD_FILE}' is unreadable: {type(exc).__name__}: {exc}") from None
        return ValueModel(backbone, head, bias=head_bias)
    model = _pretrained(AutoModelForSequenceClassification, path, "a sequence-classification model", trust_remote_code)
    score = getattr(model, "score", None)
    if not isinstance(score, nn.Linear) or score.out_features != 1:
        labels = getattr(score, "out_features", None)
        raise BackendError(
            f"model '{name}': '{path}' is a sequence-classification model, but "
            + (
                f"its score head has {labels} labels; a reward model has one (num_labels=1)."
                if labels
                else "it has no 'score' head (a Llama/Qwen-style classifier has one)."
            )
        )
    return ValueModel(model, dict(score.state_dict()), bias=head_bias)


def _pretrained(auto: Any, path: str, what: str, trust_remote_code: bool = False) -> nn.Module:
    try:
        return auto.from_pretrained(
            path,
            local_files_only=True,
            dtype=torch.float32,
            attn_implementation="eager",
            trust_remote_code=trust_remote_code,
        )
    except Exception as exc:
        raise BackendError(f"could not load {what} from '{path}': {type(exc).__name__}: {exc}") from None


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers turn text into the same ids: the same vocabulary (token -> id) and the
    same BOS/EOS/PAD ids (names and classes do not matter)."""
    if a is b:
        return True
    special = ("bos_token_id", "eos_token_id", "pad_token_id")
    if any(getattr(a, k, None) != getattr(b, k, None) for k in special):
        return False
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()


def save_hf(model: nn.Module, path: Path, stamp: Mapping[str, str] | None = None) -> None:
    """Write ``model`` (an HF PreTrainedModel) as an HF directory: config.json, generation_config.json
    and model.safetensors, from any process. (transformers' ``save_pretrained`` writes nothing on
    a process whose torch.distributed rank is not 0, which a trainer's first rank need not be.)
    A weight tied to an earlier one (lm_head to the embeddings) is stored once, as HF does. ``stamp``:
    more metadata for model.safetensors (a checkpoint's: which model and weight version it holds)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        try:
            generation.save_pretrained(path)
        except ValueError:  # settings transformers calls invalid (a model folder's own): kept as they were
            generation.to_json_file(path / "generation_config.json")
    state, seen = {}, set()
    for key, value in model.state_dict().items():
        if value.data_ptr() in seen:
            continue
        seen.add(value.data_ptr())
        state[key] = value.detach().to("cpu").contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt", **(stamp or {})})
