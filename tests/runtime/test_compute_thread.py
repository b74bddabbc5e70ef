"""The local engines compute on one thread per process (flowrl.runtime.compute): a second thread
computing starts a second OpenMP team, and libgomp then sleeps at its barriers instead of spinning
(measured: every step ~40 % slower once a run's evaluation had computed on the main thread)."""

from __future__ import annotations

import threading

import pytest
import torch

from flowrl.runtime.compute import on_compute_thread, serial_here, thread_count


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


def test_a_run_computes_on_the_compute_thread_and_leaves_the_callers_count(tmp_path, monkeypatch):
    from flowrl import api
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
