"""Reward execution: a reward function's rows scored in calls of ``reward.rows_per_call`` rows, run
by a pool of worker processes (``reward.workers``), or awaited with a concurrency limit for an
``async def`` function, each call within ``reward.timeout_s``. A call that raises or times out gets
the defined reward (``reward.on_error``): ``zero``, ``drop`` (its rows score their prompt's other
rows' mean, so their group-relative advantage is zero and they move nothing) or ``fail`` (the run
stops, naming the node and function). Errors and timeouts are counted in the node's metrics.

Workers (on Linux and macOS) are forked from the driver when first needed and kept: they inherit every registered
function, a graph file's own included, and receive only its name and the rows. A worker whose call
runs past the timeout is killed and replaced (a hung verifier cannot stall the run). With
``reward.workers=0`` (the default) a synchronous function is called once per batch in the driver,
as before.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from flowrl.errors import ConfigError

#: functions a forked worker may call, by name, and the run's task (set before the first fork; inherited)
_FUNCTIONS: dict[str, Callable[..., Any]] = {}
_TASK: list[Any] = [None]


@dataclass
class Outcome:
    """One call's result: its scores (one per row) and metrics, or why it has none."""

    scores: list[float] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the exception, in one line
    timed_out: bool = False


def _serve(conn: Connection) -> None:
    """A worker's loop: (name, rows, texts, options) in, ("ok", result) or ("error", text) out; the task is
    the one the driver held when it forked this worker (a dataset task's table is not sent per call)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle (it stops the workers)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        name, rows, texts, options = job
        try:
            result = _FUNCTIONS[name](rows, texts, _TASK[0], **options)
            conn.send(("ok", _portable(result)))
        except BaseException as exc:  # noqa: BLE001 - reported to the driver, which decides
            conn.send(("error", f"{type(exc).__name__}: {exc}".strip()))


def split_result(result: Any) -> tuple[Any, Any]:
    """A reward function's result as (scores, metrics): it returns scores, or (scores, metrics)."""
    return result if isinstance(result, tuple) and len(result) == 2 else (result, None)


def _portable(result: Any) -> Any:
    """A reward function's result with tensors and arrays as lists, and one-element metrics (numpy scalars,
    0-d tensors) as numbers (they travel back by pipe)."""
    scores, metrics = split_result(result)
    if hasattr(scores, "tolist"):
        scores = scores.tolist()
    if isinstance(metrics, Mapping):
        metrics = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}
    return (list(scores), metrics) if metrics is not None else list(scores)


class _Worker:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True, name="flowrl-reward")
        self.process.start()
        child.close()
        self.job: int | None = None  # the call it runs
        self.since = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    """``workers`` forked processes that run reward calls; one call at a time each."""

    def __init__(self, workers: int) -> None:
        self.size = workers
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()  # one batch at a time (streamed parts call from pipeline threads)

    def run(self, name: str, calls: Sequence[tuple[Any, ...]], timeout: float | None) -> list[Outcome]:
        """Each call's outcome, in order; ``calls``: (rows, texts, options)."""
        with self.lock:
            while len(self.workers) < self.size:
                self.workers.append(_Worker())
            busy: dict[Connection, _Worker] = {}
            try:
                return self._run(name, calls, timeout, busy)
            except BaseException:  # the driver was interrupted: the calls in flight are abandoned with their workers
                for w in busy.values():
                    self._replace(w)
                raise

    def _run(
        self, name: str, calls: Sequence[tuple[Any, ...]], timeout: float | None, busy: dict[Connection, _Worker]
    ) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(calls)
        todo = list(range(len(calls)))
        while todo or busy:
            for i, w in enumerate(self.workers):
                if w.job is None and todo:
                    if not w.process.is_alive():  # died while idle (a signal, the OOM killer): replaced
                        w = self.workers[i] = _Worker()
                    job = todo.pop(0)
                    try:
                        w.conn.send((name, *calls[job]))
                    except (BrokenPipeError, OSError):
                        todo.insert(0, job)
                        self._replace(w)
                        continue
                    w.job, w.since = job, time.monotonic()
                    busy[w.conn] = w
            now = time.monotonic()
            left = None if timeout is None else max(0.0, min(w.since + timeout for w in busy.values()) - now)
            for conn in wait(list(busy), timeout=left):
                w = busy.pop(conn)  # type: ignore[arg-type]
                job, w.job = w.job, None
                try:
                    status, value = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):  # the worker died (os._exit, a signal): replaced
                    status, value = "error", f"the reward worker died (exit code {w.process.exitcode})"
                    self._replace(w)
                outcomes[job] = _outcome(status, value)  # type: ignore[index]
            if timeout is not None:
                now = time.monotonic()
                for conn, w in list(busy.items()):
                    if now - w.since >= timeout:
                        outcomes[w.job] = Outcome(error=f"timed out after {timeout:g} s", timed_out=True)  # type: ignore[index]
                        busy.pop(conn)
                        self._replace(w)
        return [o if o is not None else Outcome(error="not run") for o in outcomes]

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = _Worker()

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []


def _outcome(status: str, value: Any) -> Outcome:
    if status == "error":
        return Outcome(error=str(value))
    scores, metrics = split_result(value)
    if metrics is not None and not isinstance(metrics, Mapping):
        return Outcome(error=f"returned (scores, {type(metrics).__name__}); the second item must be a dict of metrics")
    try:
        return Outcome(scores=[float(s) for s in scores], metrics=dict(metrics or {}))
    except (TypeError, ValueError) as exc:
        return Outcome(error=f"must return one number per response ({exc})")


async def _awaited(
    fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], timeout: float | None, concurrency: int
) -> list[Outcome]:
    gate = asyncio.Semaphore(concurrency)

    async def one(rows: Any, texts: Any, task: Any, options: Mapping[str, Any]) -> Outcome:
        async with gate:
            call = asyncio.ensure_future(fn(rows, texts, task, **options))
            done, _ = await asyncio.wait({call}, timeout=timeout)
            if not done:  # ours: the function's own TimeoutError is an error like any other
                call.cancel()
                return Outcome(error=f"timed out after {timeout:g} s", timed_out=True)
            try:
                result = call.result()
            except Exception as exc:  # noqa: BLE001 - the policy decides
                return Outcome(error=f"{type(exc).__name__}: {exc}".strip())
            try:
                return _outcome("ok", _portable(result))
            except (TypeError, ValueError) as exc:
                return Outcome(error=f"must return one number per response ({exc})")

    return list(await asyncio.gather(*(one(*c) for c in calls)))


def run_async(
    fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], timeout: float | None, concurrency: int
) -> list[Outcome]:
    """The calls of an ``async def`` function awaited at most ``concurrency`` at a time."""
    return run_coroutine(lambda: _awaited(fn, calls, timeout, concurrency))


def run_coroutine(make: Callable[[], Any]) -> Any:
    """``make()``'s coroutine run to its end: here, or in a thread of its own when this thread already
    runs an event loop (a notebook's); its exception is raised here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    out: list[Any] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            out.append(asyncio.run(make()))
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


@dataclass
class RewardRunner:
    """How a run calls its reward functions (`flowrl.specs.RewardConfig`)."""

    workers: int = 0
    timeout_s: float | None = None
    on_error: str = "fail"
    rows_per_call: int = 1
    concurrency: int = 16
    pool: RewardPool | None = None

    lock: threading.Lock = field(default_factory=threading.Lock)  # the pool's workers, replaced under it

    def direct(self, fn: Callable[..., Any]) -> bool:
        """Whether ``fn`` is called as before: synchronous, once per batch, in the driver (no pool), its
        error stopping the run."""
        plain = self.on_error == "fail" and self.timeout_s is None
        return self.workers == 0 and not inspect.iscoroutinefunction(fn) and plain

    def calls(self, fn: Callable[..., Any], n: int) -> list[slice]:
        """The row slices of one batch's calls, ``rows_per_call`` rows each."""
        step = max(1, self.rows_per_call)
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    def score(
        self, name: str, fn: Callable[..., Any], rows: list[Any], texts: list[str], task: Any, options: dict[str, Any]
    ) -> tuple[list[Outcome], list[slice]]:
        """Every call's outcome for one batch, and the rows each covers."""
        if inspect.iscoroutinefunction(fn):
            cuts = self.calls(fn, len(rows))
            calls = [(rows[s], texts[s], task, options) for s in cuts]
            return run_async(fn, calls, self.timeout_s, self.concurrency), cuts
        if self.workers == 0:  # one call in the driver, its error scored by on_error
            if self.timeout_s is not None:
                raise ConfigError(
                    f"reward.timeout_s={self.timeout_s:g}: reward function '{name}' is synchronous, and a call in the "
                    "driver cannot be stopped; set reward.workers >= 1 to run it in worker processes."
                )
            return [_in_driver(fn, rows, texts, task, options)], [slice(0, len(rows))]
        cuts = self.calls(fn, len(rows))
        with self.lock:
            if _FUNCTIONS.get(name) is not fn or _TASK[0] is not task:  # what forked workers inherit changed
                _FUNCTIONS[name], _TASK[0] = fn, task
                self._close()
            if self.pool is None:
                self.pool = RewardPool(self.workers)
            return self.pool.run(name, [(rows[s], texts[s], options) for s in cuts], self.timeout_s), cuts

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def _in_driver(fn: Callable[..., Any], rows: Any, texts: Any, task: Any, options: Mapping[str, Any]) -> Outcome:
    """A synchronous call in the driver (``reward.workers`` 0), its error an outcome (no timeout: a call
    here cannot be stopped; `flowrl.specs.RewardConfig` refuses one)."""
    try:
        return _outcome("ok", _portable(fn(rows, texts, task, **options)))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - the policy decides
        return Outcome(error=f"{type(exc).__name__}: {exc}".strip())
