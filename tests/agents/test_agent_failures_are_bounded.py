"""An agent that raises, returns something that is not a reward, or never returns is scored
``failure_reward`` and counted; the rollout ends on time, never a crash. The same for a ``command``
agent whose process fails, prints garbage, floods its output or hangs (killed with its process group)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from agent_play import our_threads, play, rewards

from flowrl.agents.command import MAX_OUTPUT, command


def raises(base_url):
    raise ValueError("the agent's own bug")


@pytest.mark.parametrize(
    ("value", "counted"),
    [("1.0", "bad_rewards"), (float("nan"), "bad_rewards"), (float("inf"), "bad_rewards"),
     ({"score": 1.0}, "bad_rewards"), ([1.0], "bad_rewards"), (complex(1, 0), "bad_rewards")],
)  # fmt: skip
def test_an_agent_returning_no_reward_scores_failure_reward_and_is_counted(actor, value, counted):
    seqs, metrics = play(actor, lambda: value, n=2)
    assert rewards(seqs) == [-1.0, -1.0]
    assert metrics[counted] == 2 and metrics["episodes"] == 2 and metrics["agent_errors"] == 0


def test_an_agent_that_raises_scores_failure_reward_and_the_rollout_goes_on(actor, caplog):
    seqs, metrics = play(actor, raises, n=3)
    assert rewards(seqs) == [-1.0] * 3 and metrics["agent_errors"] == 3
    assert len(seqs) == 3 and int(seqs.response_mask.sum()) >= 3  # each row a trainable (EOS) trajectory
    assert any("raised ValueError: the agent's own bug" in r.message for r in caplog.records)
    assert sum("raised ValueError" in r.message for r in caplog.records) == 1  # warned once, not per episode


@pytest.mark.parametrize(
    ("value", "reward"), [(None, 0.0), ({"reward": None}, 0.0), (True, 1.0), (3, 3.0), ({"reward": 0.5}, 0.5)]
)
def test_an_agent_returning_a_reward_or_none_is_scored_so(actor, value, reward):
    seqs, metrics = play(actor, lambda: value)
    assert rewards(seqs) == [reward]
    assert metrics["no_reward"] == (value is None or value == {"reward": None}) and metrics["bad_rewards"] == 0


def test_a_sync_agent_that_never_returns_times_out_without_holding_the_rollout(actor):
    release = threading.Event()
    try:
        seqs, metrics = play(actor, lambda: release.wait(60), n=2, timeout=0.5)
    finally:
        release.set()
    assert rewards(seqs) == [-1.0, -1.0] and metrics["timeouts"] == 2 and metrics["episodes"] == 2
    assert our_threads() == []


def test_an_async_agent_that_never_returns_is_cancelled_at_its_timeout(actor):
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    seqs, metrics = play(actor, forever, n=2, timeout=0.5)
    assert rewards(seqs) == [-1.0, -1.0] and metrics["timeouts"] == 2
    assert cancelled.wait(5)
    assert our_threads() == []


def test_a_busy_sync_agent_times_out_while_it_computes(actor):
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    try:
        seqs, metrics = play(actor, spin, timeout=0.3)
    finally:
        stop.set()
    assert metrics["timeouts"] == 1 and rewards(seqs) == [-1.0]


# ---------------------------------------------------------------- the command agent
def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "agent.py"
    path.write_text(body)
    return f"{sys.executable} {path}"


def play_command(actor, tmp_path, body, **settings):
    return play(actor, command(None, command=script(tmp_path, body)), **settings)


def test_a_command_that_exits_non_zero_is_an_agent_error_naming_its_status(actor, tmp_path, caplog):
    seqs, metrics = play_command(actor, tmp_path, "import sys; print('oops', file=sys.stderr); sys.exit(3)")
    assert rewards(seqs) == [-1.0] and metrics["agent_errors"] == 1
    assert any("status 3: oops" in r.message for r in caplog.records)


@pytest.mark.parametrize("out", ["print('not a number at all')", "print('[1, 2]')", "pass", "print('nan')"])
def test_a_command_printing_no_reward_scores_failure_reward(actor, tmp_path, out):
    seqs, metrics = play_command(actor, tmp_path, out)
    assert rewards(seqs) == [-1.0] and metrics["agent_errors"] + metrics["bad_rewards"] == 1


def test_a_command_reads_the_task_and_reports_its_reward(actor, tmp_path):
    body = (
        "import json, os, sys\n"
        "task = json.load(sys.stdin)\n"
        "assert os.environ['OPENAI_BASE_URL'].endswith('/v1') and os.environ['OPENAI_API_KEY']\n"
        "print('some log line')\n"
        "print(json.dumps({'reward': 0.25 if task['answer'] == '408' else 0.0}))\n"
    )
    seqs, metrics = play_command(actor, tmp_path, body)
    assert rewards(seqs) == [0.25] and metrics["agent_errors"] == 0


def test_a_command_flooding_its_output_is_stopped_at_the_limit(actor, tmp_path, caplog):
    body = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    seqs, metrics = play_command(actor, tmp_path, body)
    assert rewards(seqs) == [-1.0] and metrics["agent_errors"] == 1
    assert any(f"over {MAX_OUTPUT >> 20} MiB on stdout" in r.message for r in caplog.records)


@pytest.mark.slow
def test_a_hanging_command_is_killed_with_the_processes_it_started(actor, tmp_path):
    pids = tmp_path / "pids"
    body = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(120)\n"
    )
    seqs, metrics = play_command(actor, tmp_path, body, timeout=1.5)
    assert rewards(seqs) == [-1.0] and metrics["timeouts"] == 1
    deadline = time.monotonic() + 10
    alive = [int(p) for p in pids.read_text().split()]
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.05)
    assert alive == [], "the command's process group outlived its episode"


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child (a zombie is dead)
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
