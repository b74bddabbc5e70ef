"""One compute thread per process: every pass of the local engines runs on it, whichever thread asks.

torch's CPU kernels run their parallel regions on an OpenMP team of the calling thread. A second
thread computing (the run's evaluation on the main thread, the pipeline's tasks on a pool thread)
starts a second team, and with more OpenMP threads than cores libgomp stops spinning at its
barriers and sleeps in the kernel instead: every later pass was ~40 % slower on this 2-core CPU
(SmolLM2-135M: a GRPO step 7.9 s -> 11.1 s once an evaluation had run; benchmarks/real_model.py).
On one device the engines take turns anyway, so one thread costs no concurrency. The threads that
route work to it (the run's caller, the pipeline's task threads) compute serially meanwhile
(`serial_here`), so they start no team of their own.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_NAME = "flowrl-compute"
_THREADS = torch.get_num_threads()  # the compute thread's until `serial_here` gives it its caller's


def thread_count(threads: int) -> None:
    """This thread's intra-op threads. torch sets a thread's count lazily, at its first kernel, to the
    last count set in any thread: the count is read first so that the lazy setting cannot undo it."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def _new_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=_NAME, initializer=thread_count, initargs=(_THREADS,))


_pool = _new_pool()


def _fresh_pool() -> None:  # a forked child has no compute thread: give it its own
    global _pool
    _pool = _new_pool()


os.register_at_fork(after_in_child=_fresh_pool)


def on_compute_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the compute thread (directly when already on it), with the caller's
    grad mode and context variables; its result or its exception."""
    if threading.current_thread().name.startswith(_NAME):
        return fn(*args, **kwargs)
    grad, context = torch.is_grad_enabled(), contextvars.copy_context()

    def call() -> T:
        with torch.set_grad_enabled(grad):
            return context.run(fn, *args, **kwargs)

    return _pool.submit(call).result()


_serial = threading.local()


@contextlib.contextmanager
def serial_here() -> Iterator[None]:
    """This thread's torch kernels on one core while inside (its OpenMP team is not started), and the
    compute thread computing with this thread's count; both restored after. For threads that route
    work to the compute thread; nested (a run started inside a run), it changes nothing."""
    if getattr(_serial, "on", False):
        yield
        return
    before = torch.get_num_threads()
    computing = on_compute_thread(torch.get_num_threads)
    set_compute_threads(before)
    thread_count(1)
    _serial.on = True
    try:
        yield
    finally:
        _serial.on = False
        thread_count(before)
        set_compute_threads(computing)


def set_compute_threads(threads: int) -> None:
    """The compute thread's intra-op threads (config field ``threads``)."""
    on_compute_thread(thread_count, threads)
