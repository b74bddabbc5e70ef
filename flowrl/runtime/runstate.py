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
at any moment leaves the previous checkpoint as the latest.

A checkpoint is read as untrusted input: ``state.json`` is decoded into `Manifest` (typed fields with
bounds, unknown fields refused, at most `MAX_MANIFEST_BYTES`), ``driver.json`` is checked field by
field (`check_driver`) before anything is restored, and a checkpoint holding a symbolic link that
leads out of the run folder is refused (`check_inside`). Each file is stamped with what checkpoint it
belongs to: ``driver.safetensors``'s metadata holds the step, each model's ``model.safetensors`` and
``optimizer.safetensors`` the model's name and weight version (as its ``engine.json``), and
``state.json`` every model's version, so a file or model folder swapped in from another checkpoint is
refused rather than resumed from the wrong weights (a checkpoint written before the stamps is accepted
as it is). Each refusal is a ConfigError naming the file and the field; `resume` then tries the
checkpoint before it, and with none left the CLI exits 2.

Resuming rebuilds every model as the run began (so frozen models, the KL reference among them,
are exactly the original), then loads the trainable ones, the RNGs and the rollout state: the
resumed run continues exactly.
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
from typing import Annotated, Any

import msgspec
import torch

from flowrl.errors import ConfigError, FlowRLError, plain_name
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
from flowrl.specs import MAX_STEPS

FORMAT = 1
#: A larger state.json is not one flowrl wrote (it holds a few numbers and the base model's file list).
MAX_MANIFEST_BYTES = 16 << 20

_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
_FileEntry = tuple[str, _Count, int]  # [name, size, mtime_ns] of a base model weight file


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``state.json``: what a checkpoint holds and which run it belongs to (written last)."""

    format: int
    step: Annotated[int, msgspec.Meta(ge=0, le=MAX_STEPS)]  # the last step it includes (its folder's NNNNNN)
    models: list[str]  # the trainable models saved under models/ (plain folder names)
    graph_state: dict[str, float]  # Lagrange multipliers, adaptive coefficients (also in driver.json)
    data: dict[str, _Count] | None = None  # a dataset's epoch and index (None: a task that draws prompts)
    written: Annotated[float, msgspec.Meta(ge=0)]  # time.time() when written
    plan_graph: str  # the graph's fingerprint
    model: str  # the planned model's name
    seed: int
    base: list[_FileEntry] | dict[str, list[_FileEntry]] | None = None  # the base model's weight files
    # each trainable model's weight version (its engine.json's); None: written before flowrl recorded it
    versions: dict[str, _Count] | None = None


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
        save_tree(tmp / "driver", driver, {"flowrl.step": str(snapshot.step)})
        (tmp / STATE).write_text(
            json.dumps(
                {
                    "format": FORMAT,
                    "step": snapshot.step,
                    "models": models,
                    "versions": {name: int(st.trainers[name].version) for name in models},
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


#: The files and folders flowrl writes in a run folder by name: one of another kind there (a folder named
#: samples.jsonl, a file named checkpoints, a link to a device) is refused before the run starts, rather
#: than failing at its first write, possibly after training (the plots, the trace).
RUN_FILES = (".lock", "plan.yaml", "metrics.jsonl", "samples.jsonl", "trace.json", "timeline.png", "reward.png")
RUN_FOLDERS = (CHECKPOINTS, ".cache")


def check_entries(run: Path) -> None:
    """ConfigError naming the first of `RUN_FILES` / `RUN_FOLDERS` in ``run`` that is of another kind
    (a symbolic link counts as what it leads to; one leading nowhere is of no kind)."""
    for name in (*RUN_FILES, *RUN_FOLDERS):
        path = run / name
        if not os.path.lexists(path):
            continue
        folder = name in RUN_FOLDERS
        if not (path.is_dir() if folder else path.is_file()):
            found = "a folder" if path.is_dir() else "a file" if path.is_file() else "neither a file nor a folder"
            raise ConfigError(
                f"run folder '{run}': '{name}' is {found}, but flowrl keeps {'a folder' if folder else 'a file'} "
                f"there; move it away (it is not flowrl's) or name another run folder."
            )


@contextmanager
def holding(run: Path) -> Iterator[None]:
    """One flowrl process at a time in a run folder (an advisory lock, released when it exits); the
    folder's own entries are checked first (`check_entries`)."""
    import fcntl

    run.mkdir(parents=True, exist_ok=True)
    check_entries(run)
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
    for step, path in reversed(listed(run)):
        try:
            check_inside(run, path)
            _, driver = read(path, manifest)
            check_driver(path, driver, st, step)
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


def set_aside(run: Path, names: tuple[str, ...] = ("metrics.jsonl", "samples.jsonl"), why: str = "") -> list[Path]:
    """Keep what a run is about to start afresh: each non-empty file of ``names`` in ``run`` is renamed
    ``<stem>.before-resume-N<suffix>`` (the first N not taken: an earlier one is never overwritten),
    said in one line on stderr. Returns the new names."""
    kept = []
    for name in names:
        path = run / name
        if not path.is_file() or path.stat().st_size == 0:
            continue
        stem, _, suffix = name.rpartition(".")
        n = 1
        while os.path.lexists(run / f"{stem}.before-resume-{n}.{suffix}"):
            n += 1
        aside = run / f"{stem}.before-resume-{n}.{suffix}"
        os.link(path, aside)  # fails rather than replace a file that appeared meanwhile
        path.unlink()
        kept.append(aside)
        print(f"flowrl: kept the earlier {name} as {aside.name}{why}", file=sys.stderr, flush=True)
    return kept


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
    # JSON's own types (the manifest's [name, size, mtime] tuples as lists, as the plan's are)
    saved = msgspec.json.decode(msgspec.json.encode(read_manifest(path)))
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
    return path, load_tree(path / "driver", {"flowrl.step": str(saved["step"])})


def read_manifest(path: Path) -> Manifest:
    """``state.json`` of checkpoint folder ``path`` as a `Manifest`; ConfigError naming the file and
    field for anything flowrl did not write (not JSON, a mistyped, negative, huge or unknown field, a
    step that is not the folder's, a model name that is no plain folder name)."""
    file = path / STATE
    where = f"checkpoint manifest '{file}'"
    try:
        size = file.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise ConfigError(
                f"{where} is {size} bytes, more than a manifest holds ({MAX_MANIFEST_BYTES}); it is "
                "not one flowrl wrote. Remove this checkpoint folder to resume from an older one."
            )
        raw = json.loads(file.read_bytes())  # json, not msgspec: graph_state may hold NaN or Infinity
    except ConfigError:
        raise
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{where} is unreadable: {type(exc).__name__}: {str(exc)[:200]}.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} holds a JSON {type(raw).__name__}, not an object; it is not one flowrl wrote.")
    if raw.get("format") != FORMAT:
        shown = repr(raw.get("format"))[:40]
        raise ConfigError(
            f"checkpoint '{path}' has format {shown} ({where}, field 'format'); this flowrl reads {FORMAT}."
        )
    try:
        saved = msgspec.convert(raw, type=Manifest)
    except msgspec.ValidationError as exc:
        field_path = str(exc).rpartition(" - at `$")[2].rstrip("`")
        named = f", field '{field_path.lstrip('.')}'" if field_path and field_path != str(exc) else ""
        raise ConfigError(
            f"{where}{named}: {str(exc).partition(' - at ')[0]}; it is not what flowrl writes (edited or damaged?). "
            "Remove this checkpoint folder to resume from an older one."
        ) from None
    if path.name != f"step-{saved.step:06d}":
        raise ConfigError(f"{where}, field 'step': {saved.step} is not the step of its folder '{path.name}'.")
    for name in saved.models:
        if not plain_name(name):
            raise ConfigError(f"{where}, field 'models': {name[:60]!r} is not a plain folder name (a model name).")
    return saved


def check_inside(run: Path, path: Path) -> None:
    """ConfigError when checkpoint folder ``path``, or anything in it, is a symbolic link that leads
    out of run folder ``run`` (a checkpoint is read, restored and pruned as the run's own)."""
    root = run.resolve()

    def outside(entry: Path) -> bool:
        target = entry.resolve()
        return target != root and root not in target.parents

    entries = [path, *(Path(d) / n for d, dirs, files in os.walk(path) for n in (*dirs, *files))]
    for entry in entries:
        if entry.is_symlink() and outside(entry):
            raise ConfigError(
                f"checkpoint '{path}': '{entry}' is a symbolic link to '{os.readlink(entry)}', outside the run "
                f"folder '{run}'; a checkpoint holds its own files. Copy them into the run folder, or remove it."
            )


def check_driver(path: Path, driver: Any, st: RunState, step: int) -> None:
    """ConfigError naming ``driver.json``'s field that is not what `write` stored (its type, its
    bounds, a model, node or generate task this run does not have), before anything is restored."""
    file = path / "driver.json"
    required = {
        "torch_rng", "prompt_rng", "prompts_drawn", "data_fingerprint", "node_rngs", "graph_state",
        "generator_versions", "buffers", "snapshot",
    }  # fmt: skip

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(
            f"checkpoint file '{file}', field '{key}': {why}; it is not what flowrl writes (edited or damaged?). "
            "Remove this checkpoint folder to resume from an older one."
        )

    if not isinstance(driver, dict):
        raise ConfigError(f"checkpoint file '{file}' holds a {type(driver).__name__}, not the controller's state.")
    missing, extra = sorted(required - set(driver)), sorted(map(str, set(driver) - required))
    if missing or extra:
        key = (missing or extra)[0]
        raise bad(key[:60], "missing" if missing else "not a field flowrl writes")
    rng = driver["torch_rng"]
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
        raise bad("torch_rng", "not torch's RNG state (a uint8 tensor of its size)")
    try:
        random.Random().setstate(driver["prompt_rng"])
    except (TypeError, ValueError, OverflowError) as exc:
        raise bad("prompt_rng", f"not a random.Random state ({exc})") from None
    if not _count(driver["prompts_drawn"]):
        raise bad("prompts_drawn", "not a count (an int >= 0)")
    if not isinstance(driver["data_fingerprint"], str):
        raise bad("data_fingerprint", "not a string")
    nodes, shape = driver["node_rngs"], torch.Generator().get_state().shape
    if not isinstance(nodes, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.shape == shape
        for k, v in nodes.items()
    ):
        raise bad("node_rngs", "not {node: a torch.Generator's state}")
    state = driver["graph_state"]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in state.items()
    ):
        raise bad("graph_state", "not {name: number}")
    versions = driver["generator_versions"]
    if not isinstance(versions, dict) or not all(k in st.generators and _count(v) for k, v in versions.items()):
        raise bad("generator_versions", f"not {{model: version >= 0}} over this run's models {sorted(st.generators)}")
    buffers = driver["buffers"]
    from flowrl.runtime.rollout import RolloutBuffer

    if not isinstance(buffers, dict) or not all(
        k in st.sources and isinstance(v, RolloutBuffer) for k, v in buffers.items()
    ):
        raise bad("buffers", f"not {{generate node: rollout buffer}} over this run's nodes {sorted(st.sources)}")
    snap = driver["snapshot"]
    names = {f.name for f in fields(Snapshot)}
    if not isinstance(snap, dict) or set(snap) != names:
        raise bad("snapshot", f"not the pipeline's snapshot (fields {sorted(names)})")
    if snap["step"] != step or not _count(snap["next_step"]) or snap["next_step"] <= step:
        raise bad("snapshot.step", f"not the checkpoint's step {step} (or next_step not after it)")
    if not isinstance(snap["version0"], dict) or not all(_count(v) for v in snap["version0"].values()):
        raise bad("snapshot.version0", "not {model: version >= 0}")
    if not isinstance(snap["steps"], dict) or not all(
        _count(k) and k > step and isinstance(v, dict) for k, v in snap["steps"].items()
    ):
        raise bad("snapshot.steps", "not {later step: its state}")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 62


def restore(path: Path, driver: dict[str, Any], st: RunState, sync: Callable[[], None]) -> Snapshot:
    """Load the trainable models and the controller state saved in ``path``; ``sync`` then brings
    the generation replicas the restored weights. Returns the pipeline snapshot to resume from."""
    assert st.stream is not None
    saved = read_manifest(path)
    for name, group in st.trainers.items():
        if group.decl.trainable:
            folder = path / "models" / name
            if not folder.is_dir():
                raise ConfigError(f"checkpoint '{path}' has no state for model '{name}' (expected {folder}).")
            group.load_state(folder.resolve())
            want = (saved.versions or {}).get(name)
            if want is not None and group.version != want:
                raise ConfigError(
                    f"checkpoint file '{folder / 'engine.json'}': model '{name}' is at weight version "
                    f"{group.version}, but the checkpoint's {STATE} records {want}: the folder was copied in from "
                    "another checkpoint (swapped files?). Remove this checkpoint folder to resume from an older one."
                )
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


#: Records of metrics.jsonl besides the steps', by their ``kind``: an evaluation after ``step`` updates, a
#: restart after a lost worker that continues at ``step`` (`flowrl.runtime.recovery`).
EVENT_KINDS = ("eval", "restart")

#: Fields of a step record that the CLI's summary and reward.png read: a number (or null where a step may lack it).
_NUMBERS = {"reward": True, "kl": True, "response_length": True, "step_seconds": False}


def completed_metrics(path: Path, last_step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The step records of steps 0..``last_step`` in ``path`` and the evaluation records up to it (restart
    records up to it are kept in the file too), the file rewritten without what came after (steps a killed
    run did after its last checkpoint, or a half-written line; the whole file is first kept aside by
    `set_aside` when a complete step is dropped, so no number is lost). A line before that which is not a
    record flowrl writes (not JSON, a step out of order, a summary field that is not a number) is a
    ConfigError naming the line and field, and the file is left as it is."""
    records: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    problem = ""
    dropped = False
    if path.is_file():
        with path.open("rb") as fh:
            for number, line in enumerate(fh, 1):
                if len(records) > last_step:
                    # after the checkpoint's steps: dropped, the resumed run does them again
                    if _record_problem(line, -1, last_step):
                        dropped = dropped or not _record_problem(line, len(records), len(records))
                        break
                problem = _record_problem(line, len(records), last_step)
                if problem:
                    problem = f"line {number}: {problem}"
                    break
                record = msgspec.json.decode(line)
                if record.get("kind") in EVENT_KINDS:  # an evaluation after step-1 updates; a restart at step
                    if record["step"] <= last_step + 1:
                        if record["kind"] == "eval":
                            evals.append(record)
                        kept.append(record)
                    else:
                        dropped = True
                    continue
                records.append(record)
                kept.append(record)
    if len(records) != last_step + 1:
        raise ConfigError(
            f"'{path}' holds {len(records)} complete step(s), but the checkpoint is after step {last_step}; "
            f"the run folder is inconsistent{f' ({problem})' if problem else ''}. The file is left as it is."
        )
    if dropped:
        set_aside(path.parent, (path.name,), f" (it has steps after the checkpoint of step {last_step}: done again)")
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as fh:
        fh.writelines(msgspec.json.encode(r).decode() + "\n" for r in kept)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    return records, evals


def _record_problem(line: bytes, step: int, last_step: int) -> str:
    """Why ``line`` is not the record of step ``step`` (or an evaluation) of metrics.jsonl; "" when it is."""
    try:
        record = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        return f"not JSON ({exc}; {len(line)} bytes)"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a record"
    seen = record.get("step")
    if not isinstance(seen, int) or isinstance(seen, bool):
        return f"field 'step' is {type(seen).__name__}, not an int"
    if record.get("kind") in EVENT_KINDS:
        return "" if 0 <= seen else "field 'step' is negative"
    if seen != step:
        return f"field 'step' is {seen}, where step {step} comes"
    for key, optional in _NUMBERS.items():
        value = record.get(key)
        if (value is None and optional) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            continue
        return f"field '{key}' is {type(value).__name__ if key in record else 'missing'}, not a number"
    return ""


def publish_models(run: Path, trainers: Mapping[str, Any], step_checkpoint: Path | None) -> dict[str, Path]:
    """Each trainable model's final HF checkpoint in the run folder: the (first) actor's is
    ``checkpoint`` (in a graph without an actor, the first trained model's: a reward model's),
    every other model's ``checkpoint-<model>``. Taken from its folder in the last step checkpoint
    (hard links where the filesystem allows), or written now when no step ran; an older one is
    replaced atomically. Returns model -> path."""
    first_actor = next((n for n, g in trainers.items() if g.decl.role == "actor"), None)
    if first_actor is None:  # no policy: the first trained model is the run's product
        first_actor = next((n for n, g in trainers.items() if g.decl.trainable), None)
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
