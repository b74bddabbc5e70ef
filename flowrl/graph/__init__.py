"""Graph IR and authoring API."""

from flowrl.graph.ir import (
    Compute,
    Filter,
    Forward,
    Generate,
    Graph,
    GraphSpec,
    ModelDecl,
    Node,
    Reward,
    Source,
    StateDecl,
    Train,
)

__all__ = [
    "Compute",
    "Filter",
    "Forward",
    "StateDecl",
    "Generate",
    "Graph",
    "GraphSpec",
    "ModelDecl",
    "Node",
    "Reward",
    "Source",
    "Train",
]
