"""benchmarks/device_check.py in its CPU smoke mode: every part it is asked for comes back in its one JSON
line -- one that ran with the plan's memory forecast and its reason for not measuring GPU memory, one that
cannot run here skipped with its reason -- never a crash of the whole. (The GPU run is the script's own,
on a lent machine: see its docstring.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_cpu_smoke_mode_reports_each_part_in_one_json_line(tmp_path):
    empty = tmp_path / "no-model"
    empty.mkdir()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--cpu-smoke"]
    cmd += ["--parts", "smollm2_135m,llama_1b", "--smollm", str(empty), "--out", str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "cpu-smoke" and list(summary["parts"]) == ["smollm2_135m", "llama_1b"]
    smollm, llama = summary["parts"]["smollm2_135m"], summary["parts"]["llama_1b"]
    assert smollm["status"] == "skipped" and str(empty) in smollm["reason"], smollm
    assert llama["status"] == "ok", llama
    sdpa = llama["sdpa"]
    assert sdpa["status"] == "ok" and sdpa["steps"] == 1, sdpa
    assert sdpa["forecast_mib"] > 0 and sdpa["measured_mib"] is None and "CUDA" in sdpa["measured_skipped"]
    assert llama["flash_attention_2"] == {"status": "skipped", "reason": "no CUDA device"}
    assert json.loads((tmp_path / "out" / "device_check.json").read_text()) == summary
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"device_check.json", "smollm2_135m.log", "llama_1b.log"}
