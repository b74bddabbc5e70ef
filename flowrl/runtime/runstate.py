"""A run's checkpoints: what one holds, writing it after a step, and resuming a run from it.

::

    runs/<name>/checkpoints/step-NNNNNN/     (NNNNNN: the last step it includes, 0-based)
      models/<model>/    each trainable model: its HF checkpoint (config, model.safetensors,
                         tokenizer), optimizer.json + optimizer.safetensors, engine.json (version)
      driver.json + driver.safetensors
                         the controller: the torch RNG, the prompt stream (its RNG and how many
                         prompts it gave), every node's random stream, the graph state (Lagrange
                         multipliers, adaptive coefficients: also in state.json), weight versions, the
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
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgspec
import torch

from flowrl.errors import ConfigError, FlowRLError
from flowrl.runtime.checkpoint import (
    CHECKPOINTS,
    STATE,
    atomic_dir,
    clean_partial,
    latest,
    listed,
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
        start, self.drawn = self.drawn, self.drawn + n
        if hasattr(self.task, "take"):  # a dataset: its rows in epochs, where the cursor says
            return self.task.take(start, n)
        return self.task.prompts(self.rng, n)

    def position(self) -> dict[str, int] | None:
        """A dataset's epoch and index within it (None for a task that draws its prompts)."""
        return self.task.position(self.drawn) if hasattr(self.task, "position") else None

    def fingerprint(self) -> str | None:
        """A dataset's hash (None for a task that draws its prompts): the cursor's meaning."""
        return self.task.fingerprint() if hasattr(self.task, "fingerprint") else None


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
            "data_fingerprint": st.stream.fingerprint() or "",
            "node_rngs": st.rt.rng_states(),
            "graph_state": dict(st.rt.state),
            "generator_versions": {m: g.version for m, g in st.generators.items()},
            "buffers": {name: source.buffer for name, source in st.sources.items()},
            "snapshot": {f.name: getattr(snapshot, f.name) for f in fields(snapshot)},
        }
        save_tree(tmp / "driver", driver)
        (tmp / STATE).write_text(
            json.dumps(
                {
                    "format": FORMAT,
                    "step": snapshot.step,
                    "models": models,
                    "graph_state": dict(st.rt.state),
                    "data": st.stream.position(),
                    "written": time.time(),
                    **manifest,
                },
                indent=1,
            )
        )
    prune(run, keep)
    return final


def manifest(plan: Any) -> dict[str, Any]:
    """What a checkpoint must match to continue ``plan``'s run: the graph, the model built and the
    seed, and the base model's files as they were (the frozen models are rebuilt from them): one
    folder's [[name, size, mtime]], or with per-model folders (``actor=DIR,rm=DIR2``) every
    planned model folder's, {folder: files}."""

    def files(folder: str) -> list[list[Any]]:
        found = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))
        return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in found]

    cfg = plan.config
    base: Any = None
    if cfg.model is not None and "=" not in cfg.model:
        base = files(cfg.model) if Path(cfg.model).is_dir() else None
    elif cfg.model is not None:
        folders = sorted({run.checkpoint for run in plan.models.values() if run.checkpoint is not None})
        base = {folder: files(folder) for folder in folders if Path(folder).is_dir()}
    return {"plan_graph": plan.graph.fingerprint, "model": plan.target.model.name, "seed": cfg.seed, "base": base}


@contextmanager
def holding(run: Path) -> Iterator[None]:
    """One flowrl process at a time in a run folder (an advisory lock, released when it exits)."""
    import fcntl

    run.mkdir(parents=True, exist_ok=True)
    with (run / ".lock").open("a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            raise ConfigError(
                f"run folder '{run}' is in use by another flowrl process (pid {fh.read().strip() or '?'}); wait "
                "for it to end, or stop it (Ctrl-C writes a checkpoint)."
            ) from None
        fh.truncate(0)
        fh.write(str(os.getpid()))
        fh.flush()
        clean_partial(run / CHECKPOINTS)  # what a killed write left (no one else writes here now)
        clean_partial(run)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def resumable(run: Path, checkpoint: bool) -> bool:
    """Whether ``run`` has a checkpoint to continue from; False when it has none and no completed
    step either (killed before its first checkpoint: it starts over). A run made without
    checkpoints that completed steps cannot be continued."""
    if latest(run) is not None:
        return True
    metrics = run / "metrics.jsonl"
    if not checkpoint and metrics.is_file() and metrics.stat().st_size > 0:
        raise ConfigError(
            f"run folder '{run}' was run with checkpoint=false and holds no checkpoint, so it cannot be continued; "
            "start a new run (its metrics stay where they are)."
        )
    return False


def resume(run: Path, manifest: Mapping[str, Any], st: RunState, sync: Callable[[], None]) -> Snapshot:
    """Restore the newest usable checkpoint of ``run``: one that cannot be read or does not fit is
    reported and the one before it is tried."""
    failures: list[str] = []
    for _, path in reversed(listed(run)):
        try:
            _, driver = read(path, manifest)
            snapshot = restore(path, driver, st, sync)
        except FlowRLError as exc:
            if any(getattr(g.transport, "closed", False) for g in st.trainers.values()):
                raise  # a worker failed and the workers are stopped: no older checkpoint can be tried
            failures.append(str(exc))
            continue
        for why in failures:
            print(f"flowrl: skipping a newer checkpoint: {why}", file=sys.stderr, flush=True)
        if failures:
            print(f"flowrl: resuming from the older checkpoint {path}", file=sys.stderr, flush=True)
        return snapshot
    raise ConfigError(
        f"no checkpoint in '{run / CHECKPOINTS}' can be resumed: {failures[0] if failures else 'there is none'}"
        + (f" (and {len(failures) - 1} older one(s) failed too)" if len(failures) > 1 else "")
    )


def archive_trace(run: Path, resumed_from: int | None) -> None:
    """Keep the trace of the session a resumed run continues, beside the new one."""
    if not resumed_from:
        return
    for name in ("trace.json", "timeline.png"):
        old = run / name
        if old.is_file():
            stem, suffix = name.split(".")
            old.replace(run / f"{stem}.before-step-{resumed_from}.{suffix}")


def read(path: Path, manifest: Mapping[str, Any]) -> tuple[Path, dict[str, Any]]:
    """Checkpoint ``path`` and its controller state, checked against ``manifest`` (the plan and
    graph it must come from)."""
    try:
        saved = json.loads((path / STATE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint manifest '{path / STATE}' is unreadable: {exc}.") from None
    if saved.get("format") != FORMAT:
        raise ConfigError(f"checkpoint '{path}' has format {saved.get('format')!r}; this flowrl reads {FORMAT}.")
    for key, want in manifest.items():
        if key == "base" and saved.get(key) != want:
            raise ConfigError(
                f"checkpoint '{path}': the base model folder changed since the run began (its weight files now "
                f"{want!r}, then {saved.get(key)!r}); the frozen models (the KL reference) would differ. Restore the "
                "folder, or start a new run."
            )
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
    saved, now = driver.get("data_fingerprint") or None, st.stream.fingerprint()
    if saved != now:
        raise ConfigError(
            f"checkpoint '{path}': the training data changed since it was written (data.train now holds "
            f"{len(getattr(st.stream.task, 'train', ()))} rows); its cursor would lose and repeat prompts. Restore the "
            "data files, or start a new run (--model with the run's checkpoint keeps the weights)."
        )
    torch.set_rng_state(driver["torch_rng"])
    st.stream.rng.setstate(driver["prompt_rng"])
    st.stream.drawn = int(driver["prompts_drawn"])
    st.rt.restore_rngs(driver["node_rngs"])
    st.rt.state.update({k: float(v) for k, v in driver.get("graph_state", {}).items() if k in st.rt.state})
    for name, buffer in driver["buffers"].items():
        st.sources[name].buffer = buffer
    return Snapshot(**driver["snapshot"])


# ------------------------------------------------------------------ metrics.jsonl


def completed_metrics(path: Path, last_step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The step records of steps 0..``last_step`` in ``path`` and the evaluation records up to it,
    the file rewritten without what came after (steps a killed run did after its last checkpoint,
    or a half-written line)."""
    records: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = msgspec.json.decode(line)
            except msgspec.DecodeError:
                break
            if isinstance(record, dict) and record.get("kind") == "eval":  # after step-1 updates
                if isinstance(record.get("step"), int) and record["step"] <= last_step + 1:
                    evals.append(record)
                    kept.append(record)
                continue
            if len(records) > last_step or not isinstance(record, dict) or record.get("step") != len(records):
                break
            records.append(record)
            kept.append(record)
    if len(records) != last_step + 1:
        raise ConfigError(
            f"'{path}' holds {len(records)} complete step(s), but the checkpoint is after step {last_step}; "
            "the run folder is inconsistent."
        )
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as fh:
        fh.writelines(msgspec.json.encode(r).decode() + "\n" for r in kept)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    return records, evals


def publish_models(run: Path, trainers: Mapping[str, Any], step_checkpoint: Path | None) -> dict[str, Path]:
    """Each trainable model's final HF checkpoint in the run folder: the (first) actor's is
    ``checkpoint``, every other model's ``checkpoint-<model>``. Taken from its folder in the last
    step checkpoint (hard links where the filesystem allows), or written now when no step ran;
    an older one is replaced atomically. Returns model -> path."""
    first_actor = next((n for n, g in trainers.items() if g.decl.role == "actor"), None)
    published = {}
    for name, group in trainers.items():
        if group.decl.trainable:
            path = run / ("checkpoint" if name == first_actor else f"checkpoint-{name}")
            _publish(group, step_checkpoint, path)
            published[name] = path
    return published


def _publish(group: Any, step_checkpoint: Path | None, path: Path) -> None:
    import shutil

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    with atomic_dir(path) as tmp:
        if step_checkpoint is None:
            group.save(tmp.resolve())
        else:
            shutil.copytree(step_checkpoint / "models" / group.decl.name, tmp, dirs_exist_ok=True, copy_function=link)
