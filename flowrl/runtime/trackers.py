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
- **Nothing outside the run folder.** A library's cache, config and log folders default to
  ``<run>/.cache/<library>`` (`default_env`: ``WANDB_DIR``, ``WANDB_CACHE_DIR``, ``WANDB_CONFIG_DIR``,
  ``WANDB_DATA_DIR``, ``WANDB_ARTIFACT_DIR``; ``MPLCONFIGDIR`` for the plots; ``HF_HOME`` in trackio's
  child); a variable the user set wins.
- **Failures.** A library whose import fails (a broken install, an ``__init__`` that raises or exits)
  is a ConfigError naming the logger and the package. A tracker that fails while logging or closing is
  dropped with one warning on stderr and the run goes on: metrics.jsonl and the checkpoints have every
  step. ``trackers.json`` is read as untrusted input: not JSON, an unknown logger or a run id that is not
  1-64 letters, digits, ``-`` or ``_`` is a ConfigError naming the file and field (remove the file to
  start new tracker runs; metrics.jsonl keeps the numbers).
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

from flowrl.errors import BackendError, ConfigError, FlowRLError, did_you_mean

IDS = "trackers.json"  # in the run folder: {logger: run id} for the trackers that resume by id
PROJECT = "flowrl"  # wandb project, MLflow experiment and trackio project
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a tracker run id as trackers.json may hold it
MAX_IDS_BYTES = 64 << 10

#: The variables `default_env` set (to this process's current run folder), so the next run moves them
#: while a value the user set stays.
_SET: dict[str, str] = {}


def default_env(var: str, value: Path | str) -> str:
    """Set environment variable ``var`` to ``value`` unless the user set it (a value flowrl set for an
    earlier run in this process is replaced); the variable's value now."""
    if var not in os.environ or os.environ[var] == _SET.get(var):
        os.environ[var] = _SET[var] = str(value)
    return os.environ[var]


def cache_dir(run_dir: Path, library: str) -> Path:
    """Where ``library`` keeps its caches, config and logs for the run in ``run_dir``."""
    return (run_dir / ".cache" / library).resolve()


def read_ids(run_dir: Path) -> dict[str, str]:
    """``trackers.json`` of ``run_dir`` ({} when absent): {logger: run id}, checked."""
    path = run_dir / IDS
    if not path.exists():
        return {}
    fix = "remove it to start new tracker runs (metrics.jsonl keeps every number)"
    try:
        if path.stat().st_size > MAX_IDS_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, more than flowrl writes")
        ids = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"'{path}' is unreadable ({type(exc).__name__}: {str(exc)[:200]}); {fix}.") from None
    if not isinstance(ids, dict):
        raise ConfigError(f"'{path}' holds a JSON {type(ids).__name__}, not {{logger: run id}}; {fix}.")
    for name, run_id in ids.items():
        if name not in TRACKERS:
            raise ConfigError(f"'{path}', field {name[:60]!r}: not a logger ({', '.join(TRACKERS)}); {fix}.")
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            raise ConfigError(
                f"'{path}', field '{name}': {str(run_id)[:60]!r} is not a run id (1-64 letters, digits, '-' or '_'); "
                f"{fix}."
            )
    return ids


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
        _import(self.module, "tensorboard")
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
        cache = cache_dir(run_dir, "wandb")
        default_env("WANDB_DIR", run_dir.resolve())
        for var, sub in (("CACHE", "cache"), ("CONFIG", "config"), ("DATA", "data"), ("ARTIFACT", "artifacts")):
            default_env(f"WANDB_{var}_DIR", cache / sub)
        wandb = _import(self.module, "wandb")

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
        _import(self.module, "mlflow")
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
                env={**os.environ, "TRACKIO_DIR": str(folder), "HF_HOME": _hf_home(run_dir)},
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


def _hf_home(run_dir: Path) -> str:
    """trackio's child's Hugging Face folder: the user's ``HF_HOME``, else one in the run folder."""
    return os.environ.get("HF_HOME") or str(cache_dir(run_dir, "huggingface"))


def _import(logger: str, module: str) -> Any:
    """``module`` imported for ``--logger logger``; ConfigError naming both when its import fails
    (a broken install, an ``__init__`` that raises or calls sys.exit)."""
    import importlib

    try:
        return importlib.import_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: a package must not end the run
        raise ConfigError(
            f"--logger {logger} (log.loggers): importing the '{module}' package failed ({type(exc).__name__}: "
            f"{str(exc)[:300]}); its install is broken: reinstall it (pip install --force-reinstall {module}) or "
            f"drop {logger} from --logger."
        ) from None


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
        """Each tracker's ``log``; one that raises is warned about and dropped (the run goes on)."""
        metrics = flat_metrics(record)
        if metrics:
            for backend in list(self.backends):
                try:
                    backend.log(metrics, step)
                except Exception as err:
                    self._drop(backend, f"failed at step {step}", err)

    def resumed(self, records: list[dict[str, Any]]) -> None:
        """The records a resumed run keeps (its metrics.jsonl): TensorBoard re-sends those at or after
        the step it purges from (an evaluation logged just before the checkpoint)."""
        kept = [(r["step"], flat_metrics(r)) for r in records if isinstance(r.get("step"), int)]
        for backend in self.backends:
            if hasattr(backend, "resumed"):
                backend.resumed(kept)

    def close(self) -> None:
        """Ends every tracker's run; one that fails is warned about (the others still close)."""
        backends, self.backends = self.backends, []
        for backend in backends:
            try:
                backend.close()
            except Exception as err:
                print(f"flowrl: warning: {_logger(backend)} failed to close: {_why(err)}", file=sys.stderr, flush=True)

    def _drop(self, backend: Any, what: str, err: BaseException) -> None:
        self.backends.remove(backend)
        try:
            backend.close()
        except Exception:  # it failed already: the first error is the one to see
            pass
        print(
            f"flowrl: warning: {_logger(backend)} {what} ({_why(err)}); it is dropped for the rest of the run "
            "(metrics.jsonl and the checkpoints have every step).",
            file=sys.stderr,
            flush=True,
        )


def _logger(backend: Any) -> str:
    name = next((n for n, cls in TRACKERS.items() if isinstance(backend, cls)), type(backend).__name__)
    return f"--logger {name}"


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


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
    ids = read_ids(run_dir) if resume else {}
    backends: list[Any] = []
    try:
        for name in dict.fromkeys(names):
            try:
                backend = TRACKERS[name](run_dir, run_name, config, resume, ids.get(name))
            except (FlowRLError, KeyboardInterrupt):
                raise
            except BaseException as exc:  # SystemExit too: a library must not end the run unexplained
                raise BackendError(
                    f"--logger {name} (log.loggers) could not start its run in '{run_dir}': {_why(exc)}. Fix the "
                    f"'{TRACKERS[name].module}' install or its settings, or drop {name} from --logger."
                ) from None
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
