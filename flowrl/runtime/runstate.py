"""A run's checkpoints: what one holds, writing it after a step, and resuming a run from it.

::

    runs/<name>/checkpoints/step-NNNNNN/     (NNNNNN: the last step it includes, 0-based)
      models/<model>/    each trainable model: its HF checkpoint (config, model.safetensors,
                         tokenizer), optimizer.json + optimizer.safetensors, engine.json (version)
      driver.json + driver.safetensors
                         the controller: the torch RNG, the prompt stream (its RNG and how many
                         prompts it gave), every node's random stream, weight versions, the
                         rollout buffers (unfinished rollouts, token versions) and the pipeline
                         snapshot (prompts and finished rollouts of steps that ran ahead)
      state.json         the manifest, written last

The folder is written under a temporary name and renamed (`checkpoint.atomic_dir`), so a kill
at any moment leaves the previous checkpoint as the latest. Resuming rebuilds every model as
the run began (so frozen models, the KL reference among them, are exactly the original), then
loads the trainable ones, the RNGs and the rollout state: the resumed run continues exactly.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.errors import ConfigError
from flowrl.runtime.checkpoint import (
    CHECKPOINTS,
    STATE,
    atomic_dir,
    clean_partial,
    latest,
    load_tree,
    prune,
    save_tree,
    step_dir,
)
from flowrl.runtime.pipeline import Snapshot

FORMAT = 1


@dataclass
class PromptStream:
    """The run's prompts, drawn in order from the task with a seeded RNG; ``drawn`` is the cursor."""

    task: Any
    rng: random.Random
    drawn: int = 0

    def __call__(self, n: int) -> list[Any]:
        self.drawn += n
        return self.task.prompts(self.rng, n)


@dataclass
class RunState:
    """The controller's objects a checkpoint saves and restores."""

    trainers: Mapping[str, Any]  # model -> TrainingGroup
    generators: Mapping[str, Any]  # model -> GenerationGroup
    rt: Any  # NodeRuntime
    sources: Mapping[str, Any] = field(default_factory=dict)  # generate task -> StepRollout
    stream: PromptStream | None = None


def write(run: Path, snapshot: Snapshot, st: RunState, manifest: Mapping[str, Any], keep: int) -> Path:
    """The checkpoint after ``snapshot.step``; keeps the newest ``keep``."""
    assert st.stream is not None
    final = step_dir(run, snapshot.step)
    with atomic_dir(final) as tmp:
        models = []
        for name, group in st.trainers.items():
            if group.decl.trainable:
                group.save_state((tmp / "models" / name).resolve())  # workers may run elsewhere
                models.append(name)
        driver = {
            "torch_rng": torch.get_rng_state(),
            "prompt_rng": st.stream.rng.getstate(),
            "prompts_drawn": st.stream.drawn,
            "node_rngs": st.rt.rng_states(),
            "trainer_versions": {m: g.version for m, g in st.trainers.items()},
            "generator_versions": {m: g.version for m, g in st.generators.items()},
            "buffers": {name: source.buffer for name, source in st.sources.items()},
            "snapshot": {f.name: getattr(snapshot, f.name) for f in fields(snapshot)},
        }
        save_tree(tmp / "driver", driver)
        (tmp / STATE).write_text(
            json.dumps(
                {"format": FORMAT, "step": snapshot.step, "models": models, "written": time.time(), **manifest},
                indent=1,
            )
        )
    prune(run, keep)
    return final


def read(run: Path, manifest: Mapping[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint of ``run`` and its controller state, checked against
    ``manifest`` (the plan and graph it must come from); None when the run has none."""
    clean_partial(run / CHECKPOINTS)  # what a killed write left
    clean_partial(run)
    found = latest(run)
    if found is None:
        return None
    _, path = found
    try:
        saved = json.loads((path / STATE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint manifest '{path / STATE}' is unreadable: {exc}.") from None
    if saved.get("format") != FORMAT:
        raise ConfigError(f"checkpoint '{path}' has format {saved.get('format')!r}; this flowrl reads {FORMAT}.")
    for key, want in manifest.items():
        if saved.get(key) != want:
            raise ConfigError(
                f"checkpoint '{path}' was written for {key} {saved.get(key)!r}, but the run folder's plan has "
                f"{want!r}; it is not this run's checkpoint."
            )
    return path, load_tree(path / "driver")


def restore(path: Path, driver: dict[str, Any], st: RunState, sync: Callable[[], None]) -> Snapshot:
    """Load the trainable models and the controller state saved in ``path``; ``sync`` then brings
    the generation replicas the restored weights. Returns the pipeline snapshot to resume from."""
    assert st.stream is not None
    for name, group in st.trainers.items():
        if group.decl.trainable:
            folder = path / "models" / name
            if not folder.is_dir():
                raise ConfigError(f"checkpoint '{path}' has no state for model '{name}' (expected {folder}).")
            group.load_state(folder.resolve())
    sync()
    for model, version in driver["generator_versions"].items():
        st.generators[model].version = version
    torch.set_rng_state(driver["torch_rng"])
    st.stream.rng.setstate(driver["prompt_rng"])
    st.stream.drawn = int(driver["prompts_drawn"])
    st.rt.restore_rngs(driver["node_rngs"])
    for name, buffer in driver["buffers"].items():
        st.sources[name].buffer = buffer
    return Snapshot(**driver["snapshot"])


# ------------------------------------------------------------------ metrics.jsonl


def completed_metrics(path: Path, last_step: int) -> list[dict[str, Any]]:
    """The records of steps 0..``last_step`` in ``path``, rewritten without what came after (steps a
    killed run did after its last checkpoint, or a half-written line)."""
    records: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = msgspec.json.decode(line)
            except msgspec.DecodeError:
                break
            if not isinstance(record, dict) or record.get("step") != len(records):
                break
            records.append(record)
            if len(records) > last_step:
                break
    if len(records) != last_step + 1:
        raise ConfigError(
            f"'{path}' holds {len(records)} complete step(s), but the checkpoint is after step {last_step}; "
            "the run folder is inconsistent."
        )
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as fh:
        fh.writelines(msgspec.json.encode(r).decode() + "\n" for r in records)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    return records
