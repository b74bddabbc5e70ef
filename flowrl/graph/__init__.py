"""Graph IR and authoring API."""

from flowrl.graph.ir import Compute, Forward, Generate, Graph, GraphSpec, ModelDecl, Node, Reward, Train

__all__ = ["Compute", "Forward", "Generate", "Graph", "GraphSpec", "ModelDecl", "Node", "Reward", "Train"]
