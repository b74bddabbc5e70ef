"""Checkpoint files: atomic folders, and trees of tensors as safetensors + JSON (never pickle).

A checkpoint is a folder ``<run>/checkpoints/step-NNNNNN`` written under a temporary name and
renamed when complete, so it is either whole or absent; `latest` finds the newest one and
`prune` keeps the last K. State that is not an HF model (optimizer state, RNG states, the
rollout buffer, finished rollouts of later steps) is a *tree*: nested dicts, lists and tuples
of plain values, tensors and a few flowrl types; `save_tree` writes its tensors to
``<stem>.safetensors`` and the rest to ``<stem>.json``. Loading rebuilds only the types named
in `_TYPES`: a checkpoint handed to us cannot run code.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.errors import ConfigError

CHECKPOINTS = "checkpoints"
STATE = "state.json"  # the last file written into a checkpoint folder (its manifest)


def _types() -> dict[str, type]:
    from flowrl.contract.data import Completion, GenerateResult, Part, Prompt, Sequences, ToolCall, Turn
    from flowrl.runtime.rollout import RolloutBuffer, Row

    types = (Sequences, Prompt, Completion, Part, GenerateResult, Row, RolloutBuffer, Turn, ToolCall)
    return {t.__name__: t for t in types}


# ------------------------------------------------------------------ trees


def encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON-able data; its tensors go into ``tensors`` (named by position)."""
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().to("cpu").clone()  # a copy: tensors sharing memory are stored apart
        return {"$tensor": name}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        return {"$dict": [[encode(k, tensors), encode(v, tensors)] for k, v in obj.items()]}
    name = type(obj).__name__
    if _types().get(name) is type(obj):
        if is_dataclass(obj):
            items = {f.name: getattr(obj, f.name) for f in fields(obj)}
        else:
            items = msgspec.structs.asdict(obj)
        return {"$type": name, "fields": {k: encode(v, tensors) for k, v in items.items()}}
    raise TypeError(f"cannot store a {name} in a checkpoint")


def decode(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if "$tensor" in data:
        return tensors[data["$tensor"]]
    if "$float" in data:
        return float(data["$float"])
    if "$tuple" in data:
        return tuple(decode(v, tensors) for v in data["$tuple"])
    if "$dict" in data:
        return {decode(k, tensors): decode(v, tensors) for k, v in data["$dict"]}
    if "$type" in data:
        cls = _types()[data["$type"]]  # KeyError: not a type a checkpoint may hold
        return cls(**{k: decode(v, tensors) for k, v in data["fields"].items()})
    raise ValueError(f"unknown entry {sorted(data)}")


def save_tree(stem: Path, obj: Any, stamp: Mapping[str, str] | None = None) -> None:
    """``stem``.json and ``stem``.safetensors; ``stamp`` goes into the safetensors file's metadata
    (what checkpoint it belongs to: `check_stamp` compares it when read back)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    data = encode(obj, tensors)
    save_file(tensors, str(stem.with_suffix(".safetensors")), metadata=dict(stamp) if stamp else None)
    stem.with_suffix(".json").write_text(json.dumps(data))


def load_tree(stem: Path, stamp: Mapping[str, str] | None = None) -> Any:
    """What `save_tree` wrote; with ``stamp``, the safetensors file's metadata must agree (`check_stamp`)."""
    from safetensors.torch import load_file

    if stamp:
        check_stamp(stem.with_suffix(".safetensors"), stamp)
    try:
        tensors = load_file(str(stem.with_suffix(".safetensors")))
        data = json.loads(stem.with_suffix(".json").read_text())
        return decode(data, tensors)
    except Exception as exc:
        raise ConfigError(
            f"checkpoint file '{stem.with_suffix('.json')}' (or its .safetensors) is unreadable or corrupt: "
            f"{type(exc).__name__}: {exc}."
        ) from None


def read_stamp(file: Path) -> dict[str, str]:
    """The ``flowrl.*`` entries of safetensors ``file``'s metadata (empty when it has none, or cannot be
    read: reading it then fails where its tensors are loaded, naming the file)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as fh:
            meta = fh.metadata() or {}
    except Exception:
        return {}
    return {k: v for k, v in meta.items() if k.startswith("flowrl.")}


def check_stamp(file: Path, want: Mapping[str, str]) -> None:
    """ConfigError naming ``file`` when its metadata says it belongs to another checkpoint (another step,
    model or weight version) than ``want``: a file swapped in from another checkpoint folder. A file
    without the stamp (written before flowrl stamped checkpoints) is accepted."""
    saved = read_stamp(file)
    for key, value in want.items():
        if key in saved and saved[key] != value:
            raise ConfigError(
                f"checkpoint file '{file}' was written for {key.removeprefix('flowrl.')} {saved[key][:40]!r}, but "
                f"its checkpoint is for {value!r}: it was copied in from another checkpoint (swapped files?). "
                "Remove this checkpoint folder to resume from an older one."
            )


# ------------------------------------------------------------------ atomic folders


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """A temporary folder beside ``final``, renamed to ``final`` once the block completes (an older
    ``final`` is replaced); removed if the block raises."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            old = final.parent / f".old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def step_dir(run: Path, step: int) -> Path:
    return run / CHECKPOINTS / f"step-{step:06d}"


def listed(run: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints of ``run``, oldest first (temporary folders are not checkpoints)."""
    root = run / CHECKPOINTS
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("step-") and p.name[5:].isdigit() and (p / STATE).is_file():
                out.append((int(p.name[5:]), p))
    return sorted(out)


def latest(run: Path) -> tuple[int, Path] | None:
    found = listed(run)
    return found[-1] if found else None


def prune(run: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; drop leftovers of interrupted writes."""
    found = listed(run)
    for _, path in found[: max(len(found) - keep, 0)]:
        shutil.rmtree(path, ignore_errors=True)
    clean_partial(run / CHECKPOINTS)


def clean_partial(folder: Path) -> None:
    """Remove temporary folders an interrupted `atomic_dir` left in ``folder``."""
    if folder.is_dir():
        for p in folder.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)
