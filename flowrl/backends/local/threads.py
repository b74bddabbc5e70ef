"""Where the torch engine's methods run: on the process's compute thread (`flowrl.runtime.compute`),
with or without the engine's lock."""

from __future__ import annotations

import functools
from typing import Any

from flowrl.runtime.compute import on_compute_thread


def _locked(method: Any) -> Any:
    """``method`` on the process's compute thread (`flowrl.runtime.compute`), holding the
    engine's lock: one pass at a time over a module that two engines share (a LoRA policy and its
    base, `LoraBase`), from the backward's recomputation to the last token."""

    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        return on_compute_thread(locked, self, *args, **kwargs)

    return run


def _computes(method: Any) -> Any:
    """``method`` on the process's compute thread (`flowrl.runtime.compute`), without the lock: weight
    copies and checkpoint I/O, which may call one another."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        return on_compute_thread(method, *args, **kwargs)

    return run
