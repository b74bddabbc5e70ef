"""The docs' blocks that run on a private Ray cluster of this machine (``--cluster cpu:N``), in a module
of their own so that the suite's workers share the time; one private Ray at a time (the Ray test
modules' lock)."""

from __future__ import annotations

from pathlib import Path

import pytest
from docblocks import RUNNABLE, Block, params, run_block

RAY_BLOCKS = [b for b in RUNNABLE if b.uses_ray]


def test_the_docs_have_ray_blocks():
    assert RAY_BLOCKS


@pytest.mark.parametrize("block", params(RAY_BLOCKS))
def test_the_ray_block_runs(block: Block, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_block(block, folder, capsys)
