"""Survive the long tail: a micro-batch that runs out of memory -- its forward, or its train step's
forward or backward -- is computed again as two halves, with the same result, counted in the node's
metrics and said once on stderr, instead of ending the run. On CPU the test forces it with an
address-space limit (``RLIMIT_AS``) in a process of its own (tests/backends/oom_worker.py), with
glibc returning large blocks to the system when they are freed (``MALLOC_MMAP_THRESHOLD_``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl import api
from flowrl.backends.local.training import out_of_memory
from flowrl.errors import BackendError
from flowrl.plugins.manager import registry
from flowrl.runtime.executor import PlanExecutor

WORKER = Path(__file__).with_name("oom_worker.py")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")
def test_a_micro_batch_out_of_memory_is_split_in_two_with_the_same_result():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["free_oom_splits"] == 0.0  # without a limit nothing splits
    assert out["forward"]["splits"] >= 1 and out["forward"]["gap"] < 1e-5, out
    assert out["moved"] > 1e-3  # the train step moved the weights
    for case in ("train_0.6", "train_0.9"):
        got = out[case]
        assert got["oom_splits"] >= 1, (case, out)
        assert got["gap"] < 1e-4 and got["loss_gap"] < 1e-5, (case, out)  # the unsplit step's, to rounding
    assert out["train_0.6"]["restarts"] == 0  # its forward failed: split where it stood
    assert out["train_0.9"]["restarts"] >= 1  # its backward failed: the mini-batch again, split
    said = [line for line in done.stderr.splitlines() if "ran out of memory" in line]
    assert said and all("computed again as two halves" in line for line in said), done.stderr[-2000:]


def test_only_a_failed_allocation_counts_as_out_of_memory():
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_a_single_row_out_of_memory_names_the_node_and_what_to_lower():
    g, plan = api.plan("grpo", overrides=["rollout.prompts_per_step=2"], emit=lambda s: None)
    actor = PlanExecutor(registry()).engines(g, plan)[0]["actor"]
    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GiB")
    with pytest.raises(BackendError, match=r"node 'train_actor'.*1 row\(s\) ran out of memory.*max_tokens_per_micro"):
        actor._split(oom, torch.tensor([3]), "node 'train_actor' training model 'actor'")
    halves = actor._split(oom, torch.tensor([3, 4, 5]), "node 'train_actor' training model 'actor'")
    assert [h.tolist() for h in halves] == [[3, 4], [5]] and actor.oom_splits == 1
    other = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="mat1"):
        actor._split(other, torch.tensor([3, 4]), "x")
