"""Experiment trackers (--logger): each library writes offline into the run folder, and what it wrote
is read back with that library's own reader (TensorBoard's EventAccumulator, MlflowClient, wandb's
`leet inspect --json` of the .wandb file, trackio's SQLiteStorage); a resumed run appends to the
same tracker run; unknown names and missing libraries are config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flowrl.errors import ConfigError
from flowrl.runtime import trackers as trackers_mod
from flowrl.runtime.metrics import MetricsLog
from flowrl.runtime.trackers import IDS, PROJECT, flat_metrics, mlflow_key, open_trackers

CONFIG = {"seed": 3, "algo": {"kl_coef": 0.01}, "log": {"loggers": ["x"]}}
ELSEWHERE = ("WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "TRACKIO_DIR", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # sqlalchemy's, inside mlflow


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No variable that would send a tracker elsewhere; telemetry off (restored after the test)."""
    for var in ELSEWHERE:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def record(step: int) -> dict[str, Any]:
    """A step record as metrics.jsonl has it: prefixed metrics, headline, nested spans, non-numbers."""
    return {
        "step": step,
        "gen/reward": 0.5 * step,
        "eval/mean@4": step + 0.25,
        "tokens": 10 * step,
        "reward": None,
        "kind": "train",
        "stopped": False,
        "spans": {"gen": 0.125, "train": 1.0 + step},
    }


def expected(step: int) -> dict[str, float]:
    return {
        "gen/reward": 0.5 * step,
        "eval/mean@4": step + 0.25,
        "tokens": 10.0 * step,
        "spans/gen": 0.125,
        "spans/train": 1.0 + step,
    }


def log_steps(run_dir: Path, name: str, steps: range, resume: bool) -> None:
    trackers = open_trackers([name], run_dir, "grpo", CONFIG, resume)
    for step in steps:
        trackers.log(record(step), step)
    trackers.close()


def test_flatten_and_key_rules():
    assert flat_metrics(record(2)) == expected(2)
    assert flat_metrics({"step": 1, "a": {"b": {"c": 2}}, "s": "x", "l": [1]}) == {"a/b/c": 2.0}
    assert mlflow_key("eval/mean@4") == "eval/mean_at_4"
    assert mlflow_key("kl(μ)#2:x") == "kl_28_u03bc_29_232_3ax"
    assert mlflow_key("spans/gen-1.a b") == "spans/gen-1.a b"
    distinct = [f"eval/{source}/greedy" for source in ("日本", "中国", "a:b", "a;b")]
    assert len({mlflow_key(k) for k in distinct}) == len(distinct)


def test_unknown_logger_names_the_option_and_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as err:
        open_trackers(["tensorbord"], tmp_path, "grpo", CONFIG, False)
    msg = str(err.value)
    for part in ("--logger", "log.loggers", "'tensorbord'", "Did you mean 'tensorboard'", "wandb, mlflow, trackio"):
        assert part in msg
    assert not list(tmp_path.iterdir())  # nothing opened


def test_missing_library_names_the_extra(tmp_path, monkeypatch):
    real = trackers_mod.importlib.util.find_spec
    monkeypatch.setattr(trackers_mod.importlib.util, "find_spec", lambda m: None if m == "wandb" else real(m))
    with pytest.raises(ConfigError, match=r"--logger wandb .*'wandb' package.*pip install 'flowrl\[wandb\]'"):
        open_trackers(["tensorboard", "wandb"], tmp_path, "grpo", CONFIG, False)
    assert not list(tmp_path.iterdir())


def test_no_loggers_writes_nothing(tmp_path):
    trackers = open_trackers([], tmp_path, "grpo", CONFIG, False)
    trackers.log(record(0), 0)
    trackers.close()
    assert not trackers and not list(tmp_path.iterdir())


# ---------------------------------------------------------------- each library's own reader


def read_tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_mlflow(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    run = client.get_run(json.loads((run_dir / IDS).read_text())["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["algo/kl_coef"] == "0.01"
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }


def read_wandb(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    run_id = json.loads((run_dir / IDS).read_text())["wandb"]
    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert files
    for path in files:  # one per session: `wandb sync` joins them
        dump = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", str(path), "--json"],
            capture_output=True,
            text=True,
            check=True,
            env={**_env(), "WANDB_MODE": "offline"},
        ).stdout
        for line in dump.splitlines():
            rec = json.loads(line)
            if rec["type"] == "run":
                assert rec["run"]["run_id"] == run_id and rec["run"]["config"]["update"]["seed"] == 3
            if rec["type"] == "history":
                step = int(rec["history"]["step"]["num"])
                for key, value in rec["history"]["item"].items():
                    if not key.startswith("_"):
                        out.setdefault(key, []).append((step, float(value)))
    return out


TRACKIO_READ = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
print(json.dumps(SQLiteStorage.get_logs(sys.argv[1], sys.argv[2])))
"""


def read_trackio(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    dump = subprocess.run(
        [sys.executable, "-c", TRACKIO_READ, PROJECT, "grpo"],
        capture_output=True,
        text=True,
        check=True,
        env={**_env(), "TRACKIO_DIR": str(run_dir / "trackio")},
    ).stdout
    out: dict[str, list[tuple[int, float]]] = {}
    for row in json.loads(dump):
        for key, value in row.items():
            if key not in ("step", "timestamp"):
                out.setdefault(key, []).append((row["step"], value))
    return out


def _env() -> dict[str, str]:
    return dict(os.environ)


READERS = {"tensorboard": read_tensorboard, "wandb": read_wandb, "mlflow": read_mlflow, "trackio": read_trackio}
#: The key each library shows for eval/mean@4.
EVAL_KEY = {"tensorboard": "eval/mean@4", "wandb": "eval/mean@4", "mlflow": "eval/mean_at_4", "trackio": "eval/mean@4"}


@pytest.mark.parametrize("name", list(READERS))
@pytest.mark.slow
def test_logged_then_resumed_reads_back_every_step_once(name, tmp_path):
    """Steps 0-2, the run closed, reopened with resume=True, steps 3-4: the library's own reader finds
    one run with steps 0..4 once each and every numeric metric's value."""
    log_steps(tmp_path, name, range(3), resume=False)
    first_ids = json.loads((tmp_path / IDS).read_text()) if (tmp_path / IDS).is_file() else {}
    log_steps(tmp_path, name, range(3, 5), resume=True)
    if first_ids:
        assert json.loads((tmp_path / IDS).read_text()) == first_ids  # the same tracker run
    got = READERS[name](tmp_path)
    want = {k: [(s, expected(s)[k]) for s in range(5)] for k in expected(0)}
    want[EVAL_KEY[name]] = want.pop("eval/mean@4")
    assert {k: sorted(v) for k, v in got.items()} == want  # values exact in float32 too


def test_tensorboard_resume_purges_a_killed_sessions_steps_and_keeps_the_runs_records(tmp_path):
    """A session logged steps 0-4 and an evaluation at step 3, then died; its checkpoint is after step
    2. The resumed session logs 3-4 again: TensorBoard shows each step once, with the resumed values,
    and the evaluation at step 3 (the run keeps it) survives the purge."""
    trackers = open_trackers(["tensorboard"], tmp_path, "grpo", CONFIG, False)
    for step in range(5):
        trackers.log({"gen/reward": -1.0}, step)
        if step == 2:
            trackers.log({"step": 3, "kind": "eval", "eval/mean@4": 0.75}, 3)
    trackers.close()
    kept = [{"step": s, "gen/reward": -1.0} for s in range(3)] + [{"step": 3, "kind": "eval", "eval/mean@4": 0.75}]
    trackers = open_trackers(["tensorboard"], tmp_path, "grpo", CONFIG, True)
    trackers.resumed(kept)
    for step in (3, 4):
        trackers.log({"gen/reward": float(step)}, step)
    trackers.close()
    got = read_tensorboard(tmp_path)
    assert got["gen/reward"] == [(0, -1.0), (1, -1.0), (2, -1.0), (3, 3.0), (4, 4.0)]
    assert got["eval/mean@4"] == [(3, 0.75)]


@pytest.mark.slow  # 8 s: each library above has its own test
def test_all_four_at_once(tmp_path):
    trackers = open_trackers(["tensorboard", "wandb", "mlflow", "trackio"], tmp_path, "grpo", CONFIG, False)
    trackers.log(record(0), 0)
    trackers.close()
    assert set(json.loads((tmp_path / IDS).read_text())) == {"wandb", "mlflow"}
    for name, read in READERS.items():
        assert read(tmp_path)[EVAL_KEY[name]] == [(0, 0.25)], name


# ---------------------------------------------------------------- MetricsLog


class Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int]] = []
        self.kept: list[dict[str, Any]] | None = None
        self.closed = False

    def __bool__(self) -> bool:
        return True

    def log(self, record: dict[str, Any], step: int) -> None:
        self.logged.append((record, step))

    def resumed(self, records: list[dict[str, Any]]) -> None:
        self.kept = records

    def close(self) -> None:
        self.closed = True


def metrics_log(path: Path, trackers: Any, append: bool) -> MetricsLog:
    schedule = SimpleNamespace(tasks=[SimpleNamespace(name="gen", kind="generate", absorbs=())])
    result = SimpleNamespace(metrics=[])
    trace = SimpleNamespace(add_workers=lambda spans: None)
    return MetricsLog(path, schedule, result, trace, lambda: [], lambda: 4, None, append=append, trackers=trackers)


def test_metrics_log_sends_steps_and_extra_records_to_the_trackers(tmp_path):
    path, rec = tmp_path / "metrics.jsonl", Recorder()
    log = metrics_log(path, rec, append=False)
    log.step_done(0, SimpleNamespace(outputs={"gen": (0.5, {"tokens": 8, "reward": 0.25})}))
    log.log_extra({"step": 1, "kind": "eval", "eval/mean@4": 0.5})
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r for r, _ in rec.logged] == lines and [s for _, s in rec.logged] == [0, 1]
    assert lines[0]["gen/reward"] == 0.25 and lines[1]["eval/mean@4"] == 0.5
    assert rec.closed and rec.kept is None
    resumed = Recorder()
    metrics_log(path, resumed, append=True).close()
    assert resumed.kept == lines  # what the resumed run keeps, for TensorBoard's purge


def test_metrics_log_without_trackers(tmp_path):
    log = metrics_log(tmp_path / "metrics.jsonl", None, append=False)
    log.log_extra({"step": 0, "kind": "eval", "eval/mean@4": 0.5})
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["eval/mean@4"] == 0.5
