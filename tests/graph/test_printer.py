"""Printer: golden text of the built-in graphs, DOT output, PNG drawing.

Regenerate the golden files after an intended change with::

    FLOWRL_UPDATE_GOLDEN=1 python -m pytest tests/graph/test_printer.py

and read the diff before committing it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from flowrl.graph import Graph
from flowrl.graph.printer import draw_png, neighbourhood, node_line, to_dot, to_text
from flowrl.graphs import grpo, ppo, remax
from flowrl.specs import RunConfig

GOLDEN = Path(__file__).parent / "golden"
GRAPHS = {"ppo": ppo, "grpo": grpo, "remax": remax}


def _update() -> bool:
    return os.environ.get("FLOWRL_UPDATE_GOLDEN", "") not in ("", "0")


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_golden_text(name: str) -> None:
    text = to_text(GRAPHS[name].build(RunConfig()))
    path = GOLDEN / f"{name}.txt"
    if _update():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"missing golden file {path}; run with FLOWRL_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"to_text({name}) changed; rerun with FLOWRL_UPDATE_GOLDEN=1 if intended"


def test_text_is_deterministic() -> None:
    assert to_text(ppo.build(RunConfig())) == to_text(ppo.build(RunConfig()))


def _stages(text: str) -> list[list[str]]:
    """Parse the stage block of to_text back into node names per stage."""
    block = text.split("  stages")[1].split("  edges:")[0].splitlines()[1:]
    stages: list[list[str]] = []
    for line in block:
        m = re.match(r"^    (\d+\.)?\s+(\S+)", line)
        assert m, line
        if m.group(1):
            stages.append([])
        stages[-1].append(m.group(2))
    return stages


def test_ppo_text_matches_the_graph_structure() -> None:
    g = ppo.build(RunConfig())
    text = to_text(g)
    assert _stages(text) == g.stages()
    assert ["old_logprobs", "ref_logprobs", "values", "reward"] in _stages(text)
    edges = [line.strip() for line in text.split("  edges:")[1].splitlines() if line.strip()]
    assert not any(e.startswith(("ref_logprobs -> values", "values -> ref_logprobs")) for e in edges)
    assert "rollout -> train_actor: responses, actor@v before update" in edges
    assert "rollout -> train_critic: responses" in edges
    assert "values -> train_critic: values, critic@v before update" in edges
    assert "train_actor => rollout (next iteration): actor@v+1" in edges
    # one line per DAG edge plus one per loop edge
    assert len(edges) == g.dag().number_of_edges() + len(g.loop_edges())
    assert "    ref          reference  frozen     init=actor" in text.splitlines()


def test_node_line_details() -> None:
    g = Graph("details")
    g.model("actor", "actor")
    g.generate("greedy", model="actor", greedy=True, writes="greedy_responses")
    g.reward("r", fn="task", writes="r", per_char=0.05, alpha=1)
    g.train("t", model="actor", loss="ppo", reads="greedy_responses")
    assert node_line(g.nodes["greedy"]).endswith("prompts -> greedy_responses  [n=1 greedy]")
    # options are listed sorted by name
    assert node_line(g.nodes["r"]).endswith("prompts, responses -> r  [alpha=1 per_char=0.05]")
    assert "fn=task" in node_line(g.nodes["r"])
    assert "actor@v->v+1" in node_line(g.nodes["t"]) and "-> (weights)  [loss=ppo]" in node_line(g.nodes["t"])


def test_neighbourhood_marks_the_node_and_lists_key_neighbours() -> None:
    g = ppo.build(RunConfig())
    lines = neighbourhood(g, "values").splitlines()
    assert lines[0].startswith("  > values")
    others = {line.split()[0] for line in lines[1:]}
    assert others == {"rollout", "gae", "train_critic"}  # ref_logprobs shares no key with values
    assert neighbourhood(g, "nope") == ""


def test_dot_contains_every_node_and_edge_label() -> None:
    for module in GRAPHS.values():
        g = module.build(RunConfig())
        dot = to_dot(g)
        assert dot.startswith(f'digraph "{g.name}" {{') and dot.rstrip().endswith("}")
        for name in g.nodes:
            assert re.search(rf'^  "{name}" \[shape=\w+, label="{name}\\n', dot, re.M), name
        for u, v, data in g.dag().edges(data=True):
            if data.get("keys"):
                assert f'  "{u}" -> "{v}" [label="{", ".join(data["keys"])}"];' in dot
            else:
                assert f'  "{u}" -> "{v}" [style=dashed, label="{data["version"]}@v"];' in dot
        for train, gen, model in g.loop_edges():
            assert f'  "{train}" -> "{gen}" [style=dotted, constraint=false, label="{model}@v+1"];' in dot
        edge_lines = re.findall(r'^  "[^"]+" -> "[^"]+" \[', dot, re.M)
        assert len(edge_lines) == g.dag().number_of_edges() + len(g.loop_edges())


def test_dot_shapes_and_pure_version_edge() -> None:
    dot = to_dot(remax.build(RunConfig()))
    assert '"greedy" -> "train_actor" [style=dashed, label="actor@v"];' in dot
    assert '"reward" [shape=diamond' in dot
    assert '"advantages" [shape=ellipse' in dot
    assert '"train_actor" [shape=doubleoctagon' in dot


def test_draw_png_writes_a_png(tmp_path: Path) -> None:
    out = draw_png(ppo.build(RunConfig()), tmp_path / "sub" / "ppo.png")
    assert out == tmp_path / "sub" / "ppo.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


def _raft(by_row: bool) -> Graph:
    """Rejection SFT (graphs/rejection_sft.py) with a filter keeping single rows or whole groups."""
    g = Graph("raft")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=4)
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.filter("select", fn="threshold", reads="rewards responses", by_row=by_row, min_reward=1.0)
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    return g


def test_node_line_tells_a_row_filter_from_a_group_filter() -> None:
    rows, groups = (node_line(_raft(b).nodes["select"]) for b in (True, False))
    assert rows != groups
    assert "row" in rows.replace("(rows)", ""), rows  # '(rows)' is the effect column every filter shows
