"""Issue 21: `--set nodes.NAME.OPTION=VALUE` sets a node's options. A node's own graph fields, which
the graph file gives next to its options and `flowrl show` prints (a filter's ``max_rounds`` and
``groups``, a generate node's ``turns``), cannot be set that way, and are refused as "unknown
option(s) max_rounds" with a list of allowed options that leaves them out, though the user just read
``max_rounds=3`` in graphs/dapo.py. The refusal should say what the field is (part of the graph,
set in the graph file), not that it is unknown."""

from __future__ import annotations

import pytest

from flowrl.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


@pytest.mark.parametrize(
    ("graph", "setting"),
    [("dapo", "nodes.dynamic_sampling.max_rounds=5"), ("tool_use", "nodes.episodes.turns=3")],
)
def test_a_nodes_graph_field_is_named_as_such_not_as_an_unknown_option(capsys, tmp_path, graph, setting) -> None:
    code, _, err = run_cli(capsys, "plan", graph, "--set", setting, "--out", str(tmp_path / "p.yaml"))
    field = setting.split(".")[2].split("=")[0]
    assert code == 2 and field in err, err
    assert "unknown option" not in err and "graph" in err, err
