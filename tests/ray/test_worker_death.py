"""A worker that dies mid-run stops the run at once, loudly and cleanly.

This module has no shared Ray session on purpose: the executor starts its own private Ray, and
the test checks that it is shut down after the failure.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from flowrl import api
from flowrl.errors import BackendError
from flowrl.plugins.manager import registry

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # a private Ray per test, workers killed mid-run


def test_a_killed_worker_stops_the_run_naming_the_worker_group_and_iteration(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")
    overrides = [
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "steps=50",
        "backend=ray",
        "device=cpu",
        "progress=false",
        "checkpoint=false",
        f"out={tmp_path}",
    ]
    _, cfg = api.load("grpo", overrides=overrides)
    target = api.local_target(cfg, registry(), devices=2)
    g, plan = api.plan(
        "grpo", overrides=overrides, target=target, for_backend=True, options={"placement": "colocate"}, emit=print
    )
    ex = api.check(g, plan)
    out = tmp_path / "run"
    out.mkdir()
    killed = {}

    def on_step(record):
        if record["step"] == 1:  # kill rank 1 a moment into iteration 2
            worker = json.loads((out / "workers.json").read_text())[1]
            killed.update(worker)
            threading.Timer(0.05, os.kill, (worker["pid"], signal.SIGKILL)).start()

    with pytest.raises(BackendError) as info:
        api.run(g, plan, executor=ex, out_dir=out, on_step=on_step)
    msg = str(info.value)
    assert f"worker rank 1 (device group 'all', pid {killed['pid']})" in msg
    assert "iteration 2" in msg and "died" in msg
    assert not ray.is_initialized()  # the private Ray it started is shut down
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]  # whole lines only
    assert json.loads((out / "trace.json").read_text())["traceEvents"]  # the trace of what ran is kept
