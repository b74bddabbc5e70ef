"""The torch engine's weights and state: export (whole, or this rank's tensor slices) and import,
resumable checkpoints (weights, optimizer state, version; a LoRA model's adapters) and HF saves."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec
import torch
from torch import Tensor, nn

from flowrl.backends.local.models import VALUE_HEAD_FILE, ValueModel, build_causal_lm, classifier_weights, save_hf
from flowrl.backends.local.parallelize import tensor
from flowrl.backends.local.parallelize.lora import ADAPTER_FILE, merge_lora
from flowrl.backends.local.threads import _computes, _locked
from flowrl.errors import BackendError, ConfigError
from flowrl.runtime.batch import pad_id
from flowrl.runtime.checkpoint import check_stamp


class Weights:
    """`LocalModel`'s weights and checkpoints (a mixin: the engine holds the module and optimizer)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    decl: Any
    spec: Any
    hf_config: Any
    tokenizer: Any
    lora: Any
    rank: int
    distributed: bool
    version: int
    restores: int  # checkpoints loaded: what generation's merged copy of a LoRA model keys on with the version

    @_computes
    def export_weights(self) -> dict[str, Tensor]:
        """A copy of the full weights (a sharded model all-gathers them: every rank of the group calls
        this); a LoRA model's merged into the plain model's (what generation engines load)."""
        state = self._state()
        if self.lora is not None:
            return merge_lora(state, self.lora.alpha / self.lora.rank)
        return state

    def _state(self) -> dict[str, Tensor]:
        """The module's whole state dict on the host, as it is (LoRA adapters apart)."""
        if getattr(self, "pipeline", None) is not None:  # every stage's, gathered
            return self._staged_state()  # type: ignore[attr-defined]
        if self.distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
            # gathered tensors are copies already: on the host they are returned as they are (a second copy
            # of the whole model was the weight sync's peak); a tensor the module holds is copied
            held = {tensor.local(t).untyped_storage().data_ptr() for t in self.module.state_dict().values()}
            return {k: v.detach().to("cpu", copy=v.untyped_storage().data_ptr() in held) for k, v in full.items()}
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    @_computes
    def export_local_shards(self) -> dict[str, Tensor]:
        """This rank's tensor-parallel slices of the weights (`parallelize.tensor.local_shards`: gathered over
        data parallel, never over tp); every rank of the group calls this."""
        if self.lora is not None:
            raise BackendError(f"model '{self.decl.name}' trains LoRA adapters; it exports whole merged weights.")
        return tensor.local_shards(self.module)

    @_locked
    def load_local_shards(self, shards: Mapping[str, Tensor], version: int) -> None:
        """Take `export_local_shards` of a model split the same way over the same tp ranks, in place."""
        tensor.load_local_shards(self.module, dict(shards))
        self.version = version

    @_computes
    def import_weights(self, weights: Mapping[str, Tensor]) -> None:
        if self.lora is not None:
            raise BackendError(
                f"model '{self.decl.name}' trains LoRA adapters; its weights are its base model's plus them, and "
                "cannot be replaced by full weights."
            )
        if self.distributed:  # each rank keeps its pieces (tp slices, FSDP2 shards) of the whole weights
            if getattr(self, "pipeline", None) is not None:  # a tied head's copy from the embedding
                weights = self._with_tied(dict(weights))  # type: ignore[attr-defined]
            missing = _untied_keys(self.module) - set(weights)
            if missing:
                raise BackendError(f"weights for model '{self.decl.name}' lack {sorted(missing)[:3]}.")
            tensor.load_whole(self.module, dict(weights))
            return
        self.module.load_state_dict(dict(weights))

    @_computes
    def save_state(self, path: Path) -> None:
        """Everything to resume this model into ``path`` (every rank calls this; the first writes):
        the HF checkpoint, the optimizer state (safetensors + JSON) and the version."""
        from flowrl.runtime.checkpoint import save_tree

        weights = self.export_weights()
        bad = [k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise BackendError(
                f"model '{self.decl.name}' holds non-finite weights ({bad[0]}"
                f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); no checkpoint is written from them."
            )
        optimizer = self._optimizer_state()
        trained = self._trained_state() if self.lora is not None else None
        stamp = self._stamp()
        self._write(path, weights, stamp)
        if self.rank != 0:
            return
        if trained is not None:  # what resuming needs: the base comes from its own folder (or seed)
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in trained.items()}, str(path / ADAPTER_FILE), metadata=stamp)
        if optimizer is not None:
            save_tree(path / "optimizer", optimizer, stamp)
        (path / "engine.json").write_text(msgspec.json.encode({"version": self.version}).decode())

    def _stamp(self, version: int | None = None) -> dict[str, str]:
        """What a checkpoint's safetensors files record of the model they belong to (`check_stamp`)."""
        return {"flowrl.model": self.decl.name, "flowrl.version": str(self.version if version is None else version)}

    @_computes
    def load_state(self, path: Path) -> int:
        """Restore what `save_state` wrote (each rank keeps its shard); returns the version. A weights or
        optimizer file stamped for another model or weight version than ``engine.json`` (swapped in from
        another checkpoint) is refused naming it; one without a stamp (an older flowrl's) is accepted."""

        if self.lora is not None:
            return self._load_adapter_state(path)
        try:
            version = _engine_version(path)
        except Exception as exc:
            raise BackendError(
                f"checkpoint of model '{self.decl.name}' in '{path}' is unreadable: {type(exc).__name__}: {exc}."
            ) from None
        check_stamp(path / "model.safetensors", self._stamp(version))
        try:
            weights = _tensors(path / "model.safetensors")
            if isinstance(self.module, ValueModel) and not (path / VALUE_HEAD_FILE).is_file():  # a classifier
                weights = classifier_weights(weights, self.hf_config)
            elif isinstance(self.module, ValueModel):
                weights = {f"backbone.{k}": v for k, v in weights.items()}
                weights |= {f"head.{k}": v for k, v in _tensors(path / VALUE_HEAD_FILE).items()}
        except Exception as exc:
            raise BackendError(
                f"checkpoint of model '{self.decl.name}' in '{path}' is unreadable: {type(exc).__name__}: {exc}."
            ) from None
        if getattr(self, "pipeline", None) is not None:  # a tied head's copy from the embedding (stored once)
            weights = self._with_tied(weights)  # type: ignore[attr-defined]
        expected = _untied_keys(self.module)
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - set(self.module.state_dict()))
        if getattr(self, "pipeline", None) is not None:  # the other stages' tensors: theirs to load
            weights = {k: v for k, v in weights.items() if k in self.module.state_dict()}
            unexpected = []
        if missing or unexpected:
            raise BackendError(
                f"checkpoint of model '{self.decl.name}' in '{path}' does not fit the model: missing "
                f"{missing[:3]}, unexpected {unexpected[:3]}."
            )
        return self._restore(weights, path, version)

    def _trained_names(self) -> set[str]:
        """The parameters a LoRA model trains: its adapters, and a value head (every stage's)."""
        names = {n for n, p in self.module.named_parameters() if p.requires_grad}
        if getattr(self, "pipeline", None) is not None:
            return set(self._gather_stages(dict.fromkeys(names)))  # type: ignore[attr-defined]
        return names

    def _trained_state(self) -> dict[str, Tensor]:
        """What a LoRA model trains, full on every rank."""
        names = self._trained_names()
        return {k: v for k, v in self._state().items() if k in names}

    def _load_adapter_state(self, path: Path) -> int:
        """Restore a LoRA model's adapters (its base is rebuilt as at the start) and optimizer state."""

        try:
            version = _engine_version(path)
            check_stamp(path / ADAPTER_FILE, self._stamp(version))
            adapter = _tensors(path / ADAPTER_FILE)
        except ConfigError:
            raise
        except Exception as exc:
            raise BackendError(
                f"checkpoint of model '{self.decl.name}' in '{path}' has no readable LoRA adapters "
                f"({ADAPTER_FILE}): {type(exc).__name__}: {exc}. Was it written with train.lora.rank=0?"
            ) from None
        names = self._trained_names()
        if set(adapter) != names:
            raise BackendError(
                f"the LoRA adapters in '{path / ADAPTER_FILE}' do not fit model '{self.decl.name}' as configured "
                f"(train.lora rank / target_modules): missing {sorted(names - set(adapter))[:3]}, unexpected "
                f"{sorted(set(adapter) - names)[:3]}."
            )
        return self._restore(adapter, path, version)

    def _restore(self, weights: Mapping[str, Tensor], path: Path, version: int) -> int:
        """Load ``weights`` (all or part of the module's, full on every rank) and the optimizer state in
        ``path``; the engine is at ``version`` again."""
        from flowrl.runtime.checkpoint import load_tree

        own = self.module.state_dict()
        for key, value in weights.items():
            want = own[key].shape if key in own else None  # a DTensor's is the whole tensor's
            if want is not None and tuple(value.shape) != tuple(want):
                raise BackendError(
                    f"checkpoint of model '{self.decl.name}' in '{path}': tensor '{key}' has shape "
                    f"{list(value.shape)}, the model's is {list(want)}; it is not this model's checkpoint."
                )
        if self.distributed:
            tensor.load_whole(self.module, dict(weights))
        else:
            self.module.load_state_dict(weights, strict=False)
        if self.optimizer is not None:  # a trainable model's checkpoint always holds its optimizer state
            state = load_tree(path / "optimizer", self._stamp(version))
            try:
                self._load_optimizer_state(state)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
                raise BackendError(
                    f"checkpoint file '{path / 'optimizer.json'}' (with optimizer.safetensors) does not fit model "
                    f"'{self.decl.name}''s optimizer: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}."
                ) from None
        self.version = version
        self.restores += 1
        return version

    def _optimizer_state(self) -> dict[str, Any] | None:
        if self.optimizer is None:
            return None
        if getattr(self, "pipeline", None) is not None:
            return self._staged_optimizer_state()  # type: ignore[attr-defined]
        if self.distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.module, self.optimizer, options=StateDictOptions(full_state_dict=True))
        return self.optimizer.state_dict()

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        if getattr(self, "pipeline", None) is not None:
            self._load_staged_optimizer_state(state)  # type: ignore[attr-defined]
        elif self.distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            sharded = tensor.sharded_optimizer_state(self.module, state)
            set_optimizer_state_dict(
                self.module, self.optimizer, sharded, options=StateDictOptions(full_state_dict=False)
            )
        elif any(isinstance(key, str) for key in state.get("state", {})):
            # written by this model on several ranks (FSDP2's whole state, by parameter name), loaded on one:
            # a run re-planned for fewer devices (flowrl.runtime.recovery)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(
                self.module, self.optimizer, state, options=StateDictOptions(full_state_dict=False)
            )
        else:
            self.optimizer.load_state_dict(state)

    @_computes
    def save(self, path: Path, weights: Mapping[str, Tensor] | None = None) -> None:
        """An HF checkpoint, written by the group's first rank (every rank calls this)."""
        self._write(path, weights, None)

    def _write(self, path: Path, weights: Mapping[str, Tensor] | None, stamp: Mapping[str, str] | None) -> None:
        """`save`, with ``stamp`` in the weights file's metadata (a resumable checkpoint's)."""
        if weights is None and (self.distributed or self.lora is not None):
            weights = self.export_weights()
        if self.rank != 0:
            return
        path.mkdir(parents=True, exist_ok=True)
        module = self.module
        if self.distributed or self.lora is not None:  # a plain copy holding the full (merged) weights
            assert weights is not None
            module = _unsharded_copy(self, weights)
        if isinstance(module, ValueModel):
            module.save(path, stamp, pad_id(self.tokenizer))
        else:
            save_hf(module, path, stamp)
        self.tokenizer.save_pretrained(path)


class _EngineFile(msgspec.Struct, forbid_unknown_fields=True):
    """``engine.json`` of a model's checkpoint folder."""

    version: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]  # the weights' version (train steps taken)


def _engine_version(path: Path) -> int:
    """The version in ``path/engine.json`` (a msgspec error names the field: the caller reports it with the file)."""
    file = path / "engine.json"
    try:
        return msgspec.json.decode(file.read_bytes(), type=_EngineFile).version
    except msgspec.DecodeError as exc:
        raise ValueError(f"'{file.name}': {exc}") from None


def _tensors(file: Path) -> dict[str, Tensor]:
    """The tensors of safetensors ``file``; an error names the file (the caller reports it with the folder)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as exc:
        raise ValueError(f"'{file.name}': {type(exc).__name__}: {exc}") from None


def _untied_keys(module: nn.Module) -> set[str]:
    """State-dict keys, less those sharing storage with an earlier key (tied weights, stored once)."""
    keys, seen = set(), set()
    for key, value in module.state_dict().items():
        local = tensor.local(value)
        if local.numel() and local.data_ptr() in seen:
            continue
        seen.add(local.data_ptr())
        keys.add(key)
    return keys


def _unsharded_copy(engine: Any, weights: Mapping[str, Tensor]) -> nn.Module:
    lm = build_causal_lm(None, engine.hf_config, engine.spec.seed)
    module = ValueModel(lm, bias="head.bias" in weights) if engine.decl.scalar_head else lm
    module.load_state_dict(dict(weights))
    return module
