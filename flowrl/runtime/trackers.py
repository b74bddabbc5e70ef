"""Experiment trackers (``flowrl run --logger tensorboard,wandb,mlflow,trackio``, config ``log.loggers``):
the numbers of each metrics.jsonl record, sent to each tracker at the record's step.

- **Offline.** Everything stays in the run folder and nothing touches the network:
  ``tensorboard/`` (event files), ``wandb/`` (an offline run: ``wandb sync runs/NAME/wandb/offline-run-*``
  uploads it later), ``mlflow/mlflow.db`` (an SQLite store, ``mlflow ui --backend-store-uri
  sqlite:///runs/NAME/mlflow/mlflow.db``; MLflow 3 refuses its ``file:`` store unless
  ``MLFLOW_ALLOW_FILE_STORE`` is set), ``trackio/`` (its SQLite database: ``TRACKIO_DIR=runs/NAME/trackio
  trackio show``). Telemetry is off (``WANDB_ERROR_REPORTING``, ``MLFLOW_DISABLE_TELEMETRY``, unless set).
  A library's own variable that names somewhere else wins: ``WANDB_MODE=online``,
  ``MLFLOW_TRACKING_URI``, ``TRACKIO_DIR`` / ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL``.
- **Keys.** Nested dicts flatten to ``outer/inner`` (``spans: {gen: ...}`` -> ``spans/gen``); values that
  are not numbers (strings, None, booleans, lists) and ``step`` itself are left out. TensorBoard, wandb
  and trackio take keys as they are (``eval/mean@4``); MLflow refuses anything but letters, digits,
  ``_ - . /`` and spaces, so there ``@`` becomes ``_at_`` and any other refused character ``_``
  (``eval/mean@4`` -> ``eval/mean_at_4``, see `mlflow_key`).
- **Resume** appends to the same tracker run: the wandb run id and the MLflow run id are kept in
  ``trackers.json`` in the run folder (wandb writes a new offline folder per session under the same id;
  ``wandb sync`` joins them); trackio resumes the run of the same name; TensorBoard writes to the same
  folder with ``purge_step`` at the first step the resumed session logs, so steps a killed session
  did after its checkpoint do not show twice. `Trackers.resumed` re-sends to TensorBoard what that
  purge would drop but the run keeps (an evaluation logged at the checkpoint's step). wandb, MLflow
  and trackio have no purge: such a step can show twice there (the resumed run repeats its numbers).
- Each library is imported only when its logger is asked for (``pip install 'flowrl[trackers]'``
  installs all four). trackio fixes its folder when it is imported, so it runs in a child process.
"""

from __future__ import annotations

import importlib.util
import json
import numbers
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowrl.errors import BackendError, ConfigError, did_you_mean

IDS = "trackers.json"  # in the run folder: {logger: run id} for the trackers that resume by id
PROJECT = "flowrl"  # wandb project, MLflow experiment and trackio project


def flat_metrics(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a record by flattened key (``a/b`` for ``{"a": {"b": 1}}``), without ``step``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_metrics(value, f"{name}/"))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool) and name != "step":
            out[name] = float(value)
    return out


def mlflow_key(key: str) -> str:
    """A metric or param name MLflow accepts: ``@`` -> ``_at_`` (``eval/mean@4`` -> ``eval/mean_at_4``),
    any other character besides ASCII letters, digits, ``_ - . /`` and space -> its code point
    (``:`` -> ``_3a``, ``日`` -> ``_u65e5``), so keys that differ stay apart (per-source evaluations)."""

    def escape(c: str) -> str:
        return c if _MLFLOW_OK.fullmatch(c) else (f"_{ord(c):02x}" if c.isascii() else f"_u{ord(c):04x}")

    return "".join(escape(c) for c in key.replace("@", "_at_"))


_MLFLOW_OK = re.compile(r"[A-Za-z0-9_\-. /]")


class TensorBoard:
    """Scalars in ``tensorboard/`` through torch's SummaryWriter."""

    module = "tensorboard"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any], resume: bool, run_id: str | None):
        self.dir, self.resume, self.config = run_dir / "tensorboard", resume, config
        self.writer: Any = None  # made at the first step: a resumed run purges from there on
        self.kept: list[tuple[int, dict[str, float]]] = []
        self.id = None

    def resumed(self, kept: list[tuple[int, dict[str, float]]]) -> None:
        self.kept = kept

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir), purge_step=step if self.resume else None)
            if not self.resume:
                self.writer.add_text("config", f"```\n{json.dumps(self.config, indent=2, default=str)}\n```", 0)
            for kept_step, kept in self.kept:  # kept by the run, but at or after the purge step
                if kept_step >= step:
                    self._scalars(kept, kept_step)
        self._scalars(metrics, step)
        self.writer.flush()

    def _scalars(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB:
    """An offline wandb run in ``wandb/`` (``WANDB_MODE`` set: wandb's own choice)."""

    module = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any], resume: bool, run_id: str | None):
        if os.environ.get("WANDB_MODE", "offline") in ("offline", "dryrun"):
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # wandb's telemetry, sent even offline
        import wandb

        self.id = (resume and run_id) or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=PROJECT,
            dir=str(run_dir.resolve()),
            id=self.id,
            name=run_name,
            config=config,
            resume="allow",
            reinit="create_new",  # beside, not instead of, a run the user's own code has open
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            settings=wandb.Settings(console="off"),  # the CLI's terminal stays the CLI's
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run in ``mlflow/mlflow.db`` (or ``MLFLOW_TRACKING_URI``), through MlflowClient."""

    module = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any], resume: bool, run_id: str | None):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        folder = (run_dir / "mlflow").resolve()
        if not uri:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read when mlflow is imported
            folder.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{folder / 'mlflow.db'}"
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.id: str | None = None
        if resume and run_id:
            try:
                self.client.update_run(run_id, status="RUNNING")
                self.id = run_id
            except MlflowException:  # not in this store: a new run
                pass
        if self.id is None:
            exp = self.client.get_experiment_by_name(PROJECT)  # artifacts (none yet) beside the store
            exp_id = exp.experiment_id if exp else self.client.create_experiment(PROJECT, (folder / "art").as_uri())
            self.id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            from mlflow.entities import Param

            params = [Param(mlflow_key(k), str(v)) for k, v in flat_params(config).items()]
            for i in range(0, len(params), 100):  # log_batch takes 100 params at a time
                self.client.log_batch(self.id, params=params[i : i + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # and 1000 metrics
            self.client.log_batch(self.id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.id)


#: The child that runs trackio: the first line of its input is trackio.init's arguments, then one
#: ``[step, metrics]`` line per record; end of input finishes the run.
TRACKIO_CHILD = """
import json, sys
import trackio
run = trackio.init(**json.loads(sys.stdin.readline()))
for line in sys.stdin:
    step, metrics = json.loads(line)
    run.log(metrics, step=step)
run.finish()
"""


class Trackio:
    """A local trackio run in ``trackio/`` (``TRACKIO_DIR`` set: there), in a child process: trackio
    reads its folder from the environment once, when it is imported."""

    module = "trackio"

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any], resume: bool, run_id: str | None):
        folder = Path(os.environ.get("TRACKIO_DIR") or run_dir / "trackio").resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self.output = folder / "trackio.log"
        self.id = None
        with self.output.open("a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", TRACKIO_CHILD],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TRACKIO_DIR": str(folder)},
                text=True,
                start_new_session=True,  # Ctrl-C stops the run, not its logger: end of input finishes it
            )
        init = {"project": PROJECT, "name": run_name, "config": config, "resume": "allow" if resume else "never"}
        self._send(json.dumps(init, default=str))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._send(json.dumps([step, metrics]))

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            self._failed(self.proc.wait())

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        code = self.proc.wait()
        if code:
            self._failed(code)

    def _failed(self, code: int) -> None:
        tail = self.output.read_text().strip().splitlines()[-1:] if self.output.is_file() else []
        raise BackendError(f"the trackio logger stopped (exit {code}): {' '.join(tail)} (its output: {self.output})")


#: --logger NAME -> its tracker.
TRACKERS: dict[str, type[TensorBoard | WandB | MLflow | Trackio]] = {
    "tensorboard": TensorBoard,
    "wandb": WandB,
    "mlflow": MLflow,
    "trackio": Trackio,
}


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as flat ``a/b`` keys, for trackers that take only flat params (MLflow)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


class Trackers:
    """The trackers of one run: `log` sends a record's numbers to each; `close` ends their runs."""

    def __init__(self, backends: list[Any]) -> None:
        self.backends = backends

    def __bool__(self) -> bool:
        return bool(self.backends)

    def log(self, record: dict[str, Any], step: int) -> None:
        metrics = flat_metrics(record)
        if metrics:
            for backend in self.backends:
                backend.log(metrics, step)

    def resumed(self, records: list[dict[str, Any]]) -> None:
        """The records a resumed run keeps (its metrics.jsonl): TensorBoard re-sends those at or after
        the step it purges from (an evaluation logged just before the checkpoint)."""
        kept = [(r["step"], flat_metrics(r)) for r in records if isinstance(r.get("step"), int)]
        for backend in self.backends:
            if hasattr(backend, "resumed"):
                backend.resumed(kept)

    def close(self) -> None:
        """Ends every tracker's run, then raises the first error one of them had."""
        errors = []
        for backend in self.backends:
            try:
                backend.close()
            except Exception as err:  # the others still close
                errors.append(err)
        self.backends = []
        if errors:
            raise errors[0]


def check_loggers(names: Sequence[str]) -> None:
    """ConfigError for a name that is no logger, or whose library is not installed (before a run starts)."""
    known = ", ".join(TRACKERS)
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(
                f"--logger / log.loggers: unknown logger {name!r}.{did_you_mean(name, list(TRACKERS))} "
                f"Known loggers: {known} (comma-separated: --logger tensorboard,wandb)."
            )
        module = TRACKERS[name].module
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"--logger {name} (log.loggers) needs the '{module}' package, which is not installed: "
                f"pip install 'flowrl[{name}]' (or 'flowrl[trackers]' for all of {known})."
            )


def open_trackers(names: Sequence[str], run_dir: Path, run_name: str, config: dict[str, Any], resume: bool) -> Trackers:
    """The trackers ``names`` (``log.loggers``) for the run in ``run_dir``; ``resume``: append to the
    runs they had there. Unknown names and missing libraries raise ConfigError before any opens."""
    check_loggers(names)
    if not names:
        return Trackers([])
    run_dir.mkdir(parents=True, exist_ok=True)
    ids_path = run_dir / IDS
    ids: dict[str, str] = json.loads(ids_path.read_text()) if resume and ids_path.is_file() else {}
    backends: list[Any] = []
    try:
        for name in dict.fromkeys(names):
            backend = TRACKERS[name](run_dir, run_name, config, resume, ids.get(name))
            backends.append(backend)
            if backend.id is not None:
                ids[name] = backend.id
    except BaseException:
        try:
            Trackers(backends).close()
        except Exception:  # the error that stopped the opening is the one to see
            pass
        raise
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return Trackers(backends)
