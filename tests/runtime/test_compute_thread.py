"""The local engines compute on one thread per process (flowrl.runtime.compute): a second thread
computing starts a second OpenMP team, and libgomp then sleeps at its barriers instead of spinning
(measured: every step ~40 % slower once a run's evaluation had computed on the main thread). The
caller's thread computes serially during a run; ``threads`` sets the compute thread's count; nested
runs, failed runs, Ctrl-C on the main thread and a non-finite step on the compute thread leave it
usable and name what failed."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl import api
from flowrl.contract.plan import load_plan
from flowrl.runtime.compute import on_compute_thread, serial_here, thread_count

TINY = [
    "seed=1",  # a seed whose first batches have non-constant rewards (an update)
    "progress=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.mini_batches=1",  # one update per batch: the plan fuses the old-log-prob forward
    "train.micro_batch_size=5",
]
TIMING = ("step_seconds", "tokens_per_s", "spans")


def plan(graph: str = "grpo", *sets: str, steps: int = 2, **kwargs: Any):
    return api.plan(graph, overrides=[*TINY, f"steps={steps}", *sets], emit=lambda s: None, **kwargs)


def stable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING and not k.endswith("/seconds")} for r in metrics]


def _where() -> tuple[str, bool, int]:
    return threading.current_thread().name, torch.is_grad_enabled(), torch.get_num_threads()


def test_work_runs_on_one_compute_thread_with_the_callers_grad_mode():
    name, grad, _ = on_compute_thread(_where)
    assert name.startswith("flowrl-compute") and grad
    with torch.no_grad():
        assert on_compute_thread(_where)[1] is False
    other = threading.Thread(target=lambda: seen.append(on_compute_thread(_where)[0]))
    seen: list[str] = []
    other.start()
    other.join()
    assert seen == [name]  # whichever thread asks


def test_a_call_from_the_compute_thread_runs_inline_and_errors_come_back():
    assert on_compute_thread(on_compute_thread, _where)[0].startswith("flowrl-compute")  # no deadlock

    def boom() -> None:
        raise ValueError("from the compute thread")

    with pytest.raises(ValueError, match="from the compute thread"):
        on_compute_thread(boom)


def test_serial_here_gives_the_compute_thread_the_callers_count_and_restores_it():
    before = torch.get_num_threads()
    with serial_here():
        assert torch.get_num_threads() == 1
        assert on_compute_thread(_where)[2] == before
    assert torch.get_num_threads() == before


def test_a_thread_keeps_its_count_past_torchs_lazy_setting():
    """torch sets a new thread's count at its first kernel to the last count set in any thread."""
    counts: list[int] = []
    ready, go = threading.Event(), threading.Event()

    def worker() -> None:
        thread_count(2)
        ready.set()
        go.wait()
        torch.ones(100_000).add_(1)  # a kernel: torch's lazy setting would run now
        counts.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    ready.wait()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # another thread sets a count in between
    go.set()
    t.join()
    torch.set_num_threads(before)
    assert counts == [2]


@pytest.mark.slow
def test_a_run_computes_on_the_compute_thread_and_leaves_the_callers_count(tmp_path, monkeypatch):
    from flowrl.backends.local import engine

    seen: set[str] = set()
    train = engine.LocalModel.train.__wrapped__

    def recorded(self, *args, **kwargs):
        seen.add(threading.current_thread().name)
        return train(self, *args, **kwargs)

    monkeypatch.setattr(engine.LocalModel, "train", engine._locked(recorded))
    before = torch.get_num_threads()
    g, plan = api.plan(
        "grpo",
        overrides=["steps=2", "progress=false", "checkpoint=false", "eval.every=1", f"out={tmp_path}"],
        emit=lambda s: None,
    )
    api.run(g, plan)
    assert len(seen) == 1 and next(iter(seen)).startswith("flowrl-compute")
    assert torch.get_num_threads() == before


def _threads_seen(tmp_path: Path, *sets: str) -> list[tuple[str, int, int]]:
    g, p = plan("grpo", "checkpoint=false", *sets, steps=1)
    seen: list[tuple[str, int, int]] = []

    def on_step(_: dict) -> None:  # called on the run's caller thread
        seen.append(
            (threading.current_thread().name, torch.get_num_threads(), on_compute_thread(torch.get_num_threads))
        )

    before = torch.get_num_threads()
    api.run(g, p.with_run_settings({"out": str(tmp_path)}), on_step=on_step)
    assert torch.get_num_threads() == before  # the caller's count comes back
    return seen


@pytest.mark.slow
def test_the_callers_thread_computes_serially_during_a_run(tmp_path):
    ((name, caller, compute),) = _threads_seen(tmp_path)
    assert name == threading.current_thread().name and caller == 1


def test_the_callers_thread_computes_serially_with_threads_configured(tmp_path):
    ((_, caller, compute),) = _threads_seen(tmp_path, "threads=2")
    assert compute == 2  # the engines compute with the configured count
    assert caller == 1


@pytest.mark.slow
def test_a_nested_run_leaves_the_outer_runs_compute_threads_alone(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the outer run's engines compute on two threads (tests default to one)
    try:
        g, p = plan("grpo", "checkpoint=false", steps=2)
        counts: list[int] = []

        def on_step(record: dict) -> None:
            counts.append(on_compute_thread(torch.get_num_threads))
            if record["step"] == 0:  # e.g. a quick side run from a callback
                gi, pi = plan("grpo", "checkpoint=false", "rollout.prompts_per_step=1", steps=1)
                api.run(gi, pi.with_run_settings({"out": str(tmp_path / "inner")}))

        api.run(g, p.with_run_settings({"out": str(tmp_path / "outer")}), on_step=on_step)
        assert counts[0] == 2
        assert counts[1] == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_run_after_a_failed_run_in_the_same_process_equals_a_fresh_one(tmp_path):
    """A run that fails mid-way (its caller raising while the next step's work is in flight) leaves the
    compute thread usable: the next run in the process gives the metrics the first run gave."""
    g, p = plan("grpo", "checkpoint=false", steps=2)
    first = api.run(g, p.with_run_settings({"out": str(tmp_path / "a")}))

    def fail(record: dict) -> None:
        raise Stop

    with pytest.raises(Stop):
        api.run(g, p.with_run_settings({"out": str(tmp_path / "b")}), on_step=fail)
    again = api.run(g, p.with_run_settings({"out": str(tmp_path / "c")}))
    assert stable(again.metrics) == stable(first.metrics)
    assert on_compute_thread(threading.current_thread).name.startswith("flowrl-compute")


def test_a_non_finite_fused_step_on_the_compute_thread_stops_naming_the_node_and_step(tmp_path, monkeypatch):
    """The train step (its own forward computing the old log-probs) runs on the compute thread; a
    non-finite loss there still stops the run naming the node and the step (README)."""
    from flowrl.backends.local import engine

    real = engine.LocalModel._outputs

    def poisoned(self, seqs, output):
        out = real(self, seqs, output)
        return out * float("nan") if torch.is_grad_enabled() else out  # the train step's forward only

    monkeypatch.setattr(engine.LocalModel, "_outputs", poisoned)
    g, p = plan("grpo", "checkpoint=false", steps=1)
    assert p.fused
    with pytest.raises(Exception, match=r"node 'train_actor'.*not finite.*\(step 0\)"):
        api.run(g, p.with_run_settings({"out": str(tmp_path)}))


class Stop(Exception):
    pass


@pytest.mark.slow
def test_a_fused_run_stopped_by_ctrl_c_resumes_to_the_uninterrupted_run(tmp_path):
    """Ctrl-C (SIGINT to this process, handled by the run on the main thread while the engines compute
    on the compute thread) stops after the current step with a checkpoint; --resume then gives the
    metrics of the run that was never stopped."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the run installs its Ctrl-C handler on the main thread only")
    g, p = plan("grpo", "save_every=0", steps=4)
    assert p.fused
    whole = api.run(g, p.with_run_settings({"out": str(tmp_path / "whole")}))
    sent = []

    def ctrl_c(record: dict) -> None:
        if record["step"] == 1 and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)

    first = api.run(g, p.with_run_settings({"out": str(tmp_path / "part")}), on_step=ctrl_c)
    folder = first.out_dir
    assert first.stopped is not None and first.stopped < 3 and first.last_checkpoint is not None
    resumed = api.run(g, load_plan(folder / "plan.yaml"), out_dir=folder, resume=True)
    assert resumed.resumed_from == first.stopped + 1
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    assert stable(lines) == stable(whole.metrics)
