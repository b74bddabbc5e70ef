"""Issue 21: a filter keeps whole groups or, with by_row=True, single rows (graphs/rejection_sft.py).
`flowrl show` prints a row filter exactly as a group filter ("[groups=prompts_per_step max_rounds=1
...]"), so the one fact that decides what the nodes after it see is not shown."""

from __future__ import annotations

from flowrl.graph import Graph
from flowrl.graph.printer import node_line


def graph(by_row: bool) -> Graph:
    g = Graph("raft")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=4)
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.filter("select", fn="threshold", reads="rewards responses", by_row=by_row, min_reward=1.0)
    g.train("train_actor", model="actor", loss="sft", reads="responses")
    return g


def test_show_tells_a_row_filter_from_a_group_filter() -> None:
    rows, groups = (node_line(graph(b).nodes["select"]) for b in (True, False))
    assert rows != groups
    assert "row" in rows.replace("(rows)", ""), rows  # '(rows)' is the effect column every filter shows
