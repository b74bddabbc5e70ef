"""Whole runs and the CLI with agents: a run whose agent raises on every episode completes and reports
``agent_errors``; the run's end closes its endpoint and leaves none of its threads; `flowrl show` and
`flowrl plan` print the agent; a graph that misuses ``agent=`` is a clear error, never a traceback."""

from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path

import pytest
from agent_play import our_threads
from helpers import SMALL_RUN, run_cli

from flowrl import api
from flowrl.runtime.executor import run_dir

GRAPH = """
from flowrl.graph import Graph

def build(cfg):
    g = Graph("agent_graph")
    g.model("actor", "actor")
    g.generate("episodes", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt,
               {agent}, turns=2)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="agent", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""


def graph_file(tmp_path: Path, agent: str, name: str = "agent_graph") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(GRAPH).replace("{agent}", agent))
    return str(path)


@pytest.mark.slow
def test_a_run_whose_agent_always_raises_completes_and_reports_agent_errors(tmp_path):
    urls = tmp_path / "urls.txt"
    (tmp_path / "broken_agent.py").write_text(
        f"def run(base_url):\n    open({str(urls)!r}, 'a').write(base_url + '\\n')\n    raise RuntimeError('broken')\n"
    )
    source = graph_file(tmp_path, f'agent="{tmp_path}/broken_agent.py:run"')
    graph, plan = api.plan(source, overrides=SMALL_RUN, flags={"steps": 2}, emit=lambda s: None)
    out = api.run(graph, plan, out_dir=run_dir(str(tmp_path), "run")).out_dir
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(r["episodes/agent_errors"] == r["episodes/episodes"] == 4 for r in rows)
    assert all(r["episodes/agent_reward"] == 0.0 for r in rows)
    # the run's end closed the endpoint: its port takes no connection, and no thread of ours is left
    port = int(urls.read_text().split()[0].split(":")[2].split("/")[0])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert our_threads() == []


def test_show_prints_the_agent(capsys):
    code, out, err = run_cli(capsys, "show", "graphs/agent_calculator.py")
    assert code == 0 and "agent=examples/agents/calculator_agent.py:run turns=3 timeout=60s" in out


def test_plan_prints_the_agent(capsys):
    code, out, err = run_cli(capsys, "plan", "graphs/agent_calculator.py")
    assert code == 0 and "examples/agents/calculator_agent.py:run" in out


@pytest.mark.parametrize(
    ("agent", "says"),
    [
        ('agent="examples/agents/calculator_agent.py:run", env="calc"', "give env=NAME or agent=NAME, not both"),
        ('agent="nonexistent.py:fn"', "the file 'nonexistent.py' does not exist"),
        ('agent="examples/agents/calculator_agent.py:nothing"', "has no attribute 'nothing'"),
        ('agent="nosuchagent"', "unknown agent 'nosuchagent'"),
        ('agent=""', "agent must name a registered agent"),
    ],
)
def test_a_misused_agent_is_a_clear_error_through_the_cli(tmp_path, capsys, agent, says):
    code, _, err = run_cli(capsys, "plan", graph_file(tmp_path, agent))
    assert code != 0 and says in err and "Traceback" not in err


def test_a_command_agent_without_its_command_is_a_clear_error_naming_the_node(tmp_path, capsys):
    source = graph_file(tmp_path, 'agent="command"')
    code, _, err = run_cli(capsys, "run", source, "--steps", "1", "--out", str(tmp_path / "out"),
                           *(f"--set={s}" for s in SMALL_RUN))  # fmt: skip
    assert code != 0 and "Traceback" not in err
    assert "node 'episodes': agent 'command' needs the option command=" in err
