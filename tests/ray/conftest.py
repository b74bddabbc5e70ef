"""The Ray modules run one at a time, also under `pytest -n 2`: a module holds an exclusive lock on a
file while it runs, so two private Rays never run at once (a test that checks a failed run leaves no
raylet behind would otherwise see the other module's)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator

import pytest

LOCK = os.path.join(tempfile.gettempdir(), "flowrl-tests-ray.lock")


@pytest.fixture(scope="module", autouse=True)
def _one_ray_module_at_a_time() -> Iterator[None]:
    with open(LOCK, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
