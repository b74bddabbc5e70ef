"""Stable text form of a graph (golden-tested), DOT, and a PNG drawing."""

from __future__ import annotations

from pathlib import Path

from flowrl.graph.ir import Graph, Node


def _detail(node: Node) -> str:
    parts = node.details()
    if node.ports:
        parts.append("ports=" + ",".join(f"{p}:{k}" for p, k in node.ports.items()))
    parts.extend(f"{k}={v}" for k, v in sorted(node.options.items()))
    return " ".join(parts)


def node_line(node: Node) -> str:
    out = f"({node.effect or 'state'})"  # what a node that writes no keys produces
    flow = f"{', '.join(node.reads)} -> {', '.join(node.writes) or out}"
    return f"{node.name:<16} {node.kind:<9} {node.label():<18} {flow}" + (
        f"  [{_detail(node)}]" if _detail(node) else ""
    )


def to_text(graph: Graph) -> str:
    """A stable, human-readable listing: models, nodes by parallel stage, edges."""
    lines = [f"graph {graph.name}", f"  inputs: {', '.join(graph.inputs)}", "  models:"]
    for m in graph.models.values():
        state = "trainable" if m.trainable else "frozen"
        lines.append(f"    {m.name:<12} {m.role:<10} {state:<10} init={m.init_from or 'base'}")
    lines.append("  stages (nodes in one stage have no path between them and may run in parallel):")
    for i, stage in enumerate(graph.stages(), 1):
        for j, name in enumerate(stage):
            label = f"{i}." if j == 0 else ""
            lines.append(f"    {label:<3} {node_line(graph.nodes[name])}")
    lines.append("  edges:")
    dag = graph.dag()
    for name in graph.order():
        for _, dst, data in sorted(dag.out_edges(name, data=True), key=lambda e: e[1]):
            labels = list(data.get("keys", []))
            if "version" in data:
                labels.append(f"{data['version']}@v before update")
            if "state" in data:
                labels.append(f"state {data['state']} read before update")
            if "rows" in data:
                labels.append("the rows it keeps")
            lines.append(f"    {name} -> {dst}: {', '.join(labels)}")
    for train, gen, model in graph.loop_edges():
        lines.append(f"    {train} => {gen} (next iteration): {model}@v+1")
    return "\n".join(lines) + "\n"


def neighbourhood(graph: Graph, name: str) -> str:
    """The node and its key-neighbours, for error messages (works on unverified graphs)."""
    if name not in graph.nodes:
        return ""
    node = graph.nodes[name]
    related = [node]
    for other in graph.nodes.values():
        if other is not node and (set(other.writes) & set(node.reads) or set(node.writes) & set(other.reads)):
            related.append(other)
    marks = ["  > " if n is node else "    " for n in related]
    return "\n".join(m + node_line(n) for m, n in zip(marks, related))


def to_dot(graph: Graph) -> str:
    """Graphviz DOT: data edges solid (labelled with keys), version edges dashed, loop edges dotted."""
    out = [f'digraph "{graph.name}" {{', "  rankdir=TB;", '  node [fontname="Helvetica"];']
    for node in graph.nodes.values():
        label = f"{node.name}\\n{node.kind} {node.label()}"
        out.append(f'  "{node.name}" [shape={node.dot_shape}, label="{label}"];')
    for u, v, data in graph.dag().edges(data=True):
        if data.get("keys"):
            out.append(f'  "{u}" -> "{v}" [label="{", ".join(data["keys"])}"];')
        else:
            label = f"{data['version']}@v" if "version" in data else data.get("state") or "rows"
            out.append(f'  "{u}" -> "{v}" [style=dashed, label="{label}"];')
    for train, gen, model in graph.loop_edges():
        out.append(f'  "{train}" -> "{gen}" [style=dotted, constraint=false, label="{model}@v+1"];')
    out.append("}")
    return "\n".join(out) + "\n"


def draw_png(graph: Graph, path: str | Path) -> Path:
    """Draw the graph with matplotlib, one row per parallel stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    dag = graph.dag()
    stages = graph.stages()
    pos = {}
    for row, stage in enumerate(stages):
        for col, name in enumerate(stage):
            pos[name] = (col - (len(stage) - 1) / 2, -row)
    width = max(len(s) for s in stages)
    fig, ax = plt.subplots(figsize=(max(6, 2.8 * width), 1.4 * len(stages) + 1))
    data_edges = [(u, v) for u, v, d in dag.edges(data=True) if d.get("keys")]
    version_edges = [(u, v) for u, v, d in dag.edges(data=True) if not d.get("keys")]
    nx.draw_networkx_edges(dag, pos, edgelist=data_edges, ax=ax, arrows=True, node_size=3000, edge_color="#444")
    nx.draw_networkx_edges(
        dag, pos, edgelist=version_edges, ax=ax, arrows=True, node_size=3000, style="dashed", edge_color="#aaa"
    )
    nx.draw_networkx_edge_labels(
        dag,
        pos,
        edge_labels={(u, v): ", ".join(d["keys"]) for u, v, d in dag.edges(data=True) if d.get("keys")},
        font_size=7,
        ax=ax,
    )
    labels = {n: f"{n}\n{graph.nodes[n].kind}\n{graph.nodes[n].label()}" for n in dag.nodes}
    nx.draw_networkx_nodes(
        dag, pos, ax=ax, node_size=3000, node_shape="s", node_color=[graph.nodes[n].color for n in dag.nodes]
    )
    nx.draw_networkx_labels(dag, pos, labels=labels, font_size=7, ax=ax)
    ax.set_title(f"{graph.name}: one row per stage; dashed = model version order", fontsize=9)
    ax.axis("off")
    ax.margins(0.15)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
