"""The graph IR: models, nodes with declared read/write keys, edges derived from keys.

An algorithm is a function returning a `Graph`. Building a graph runs nothing; it only
records *models* (trainable or frozen, which one initialises from which) and *nodes*
(generate, forward, reward, compute, train) with the data keys each reads and writes.

Edges are never written by hand:
- a **data edge** u -> v for every key that u writes and v reads;
- a **version edge** u -> t when u uses model M at version v and t is the train node that
  produces M@v+1 (u must see the old weights, so it runs first);
- a **loop-carried edge** t -> g (the next iteration's generate reads M@v+1). It is kept out
  of the per-iteration DAG; the staleness pass may relax it.

`verify()` is the single home of the invariants.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Literal

import msgspec
import networkx as nx

from flowrl.errors import GraphError, did_you_mean, plain_name
from flowrl.specs import MAX_SAMPLES, Spec

Role = Literal["actor", "critic", "reference", "reward", "cost"]
ForwardOutput = Literal["logprobs", "values", "scores"]

#: Roles whose models carry a scalar head (values or scores) instead of sampling tokens.
SCALAR_ROLES = frozenset({"critic", "reward", "cost"})


class ModelDecl(Spec):
    """A model the graph uses. `init_from=None` means the base checkpoint (`--model`)."""

    name: str
    role: Role
    trainable: bool
    init_from: str | None = None

    @property
    def scalar_head(self) -> bool:
        return self.role in SCALAR_ROLES


class _Node(Spec, frozen=True, kw_only=True, tag_field="kind"):
    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    options: dict[str, Any] = {}

    model: str | None = None  # overridden where a node runs on a model

    @property
    def kind(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[attr-defined]


class Generate(_Node, frozen=True, tag="generate"):
    """Sample `n` responses per prompt from `model` (greedy=True: one argmax response)."""

    model: str
    n: int = 1
    greedy: bool = False


class Forward(_Node, frozen=True, tag="forward"):
    """Score given sequences with `model`: token log-probs, token values, or a scalar score."""

    model: str
    output: ForwardOutput


class Reward(_Node, frozen=True, tag="reward"):
    """A rule-based reward function `fn` (a registered reward function)."""

    fn: str


class Compute(_Node, frozen=True, tag="compute"):
    """A tensor computation `fn` on keys (advantage estimators, filters)."""

    fn: str


class Train(_Node, frozen=True, tag="train"):
    """Update `model` with `loss`; produces model@v+1."""

    model: str
    loss: str


Node = Generate | Forward | Reward | Compute | Train
NODE_KINDS = ("generate", "forward", "reward", "compute", "train")


class GraphSpec(Spec):
    """The serialisable form of a graph; its JSON encoding gives the fingerprint."""

    name: str
    inputs: tuple[str, ...]
    models: tuple[ModelDecl, ...]
    nodes: tuple[Node, ...]


def _keys(value: Iterable[str] | str, what: str, node: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split()
    keys = tuple(value)
    for key in keys:
        if not isinstance(key, str) or not key.isidentifier():
            raise GraphError(
                f"node '{node}': {what} key {key!r} is not a valid key name (use identifiers like 'old_logprobs')."
            )
    if len(set(keys)) != len(keys):
        raise GraphError(f"node '{node}': {what} lists a key twice: {keys}.")
    return keys


class Graph:
    """An RL algorithm as a dataflow graph. Build it with the methods below, then `verify()`."""

    def __init__(self, name: str, inputs: Iterable[str] = ("prompts",)) -> None:
        if not plain_name(name):
            raise GraphError(
                f"graph name {name!r} must be one plain folder name (no '/', '\\' or '..'): runs go in it."
            )
        self.name = name
        self.inputs = _keys(inputs, "input", "<graph inputs>")
        self.models: dict[str, ModelDecl] = {}
        self.nodes: dict[str, Node] = {}

    # ---------------------------------------------------------------- authoring
    def model(
        self, name: str, role: Role = "actor", *, trainable: bool | None = None, init_from: str | None = None
    ) -> str:
        """Declare a model. Actors and critics are trainable by default; others are frozen."""
        if not isinstance(name, str) or not name:
            raise GraphError(f"graph '{self.name}': a model name must be a non-empty string, got {name!r}.")
        if name in self.models:
            raise GraphError(f"model '{name}' is declared twice in graph '{self.name}'.")
        if role not in ("actor", "critic", "reference", "reward", "cost"):
            raise GraphError(f"model '{name}': unknown role {role!r} (actor, critic, reference, reward, cost).")
        if trainable is None:
            trainable = role in ("actor", "critic")
        self.models[name] = ModelDecl(name=name, role=role, trainable=trainable, init_from=init_from)
        return name

    def _add(self, node: Node) -> str:
        if not isinstance(node.name, str) or not node.name:
            raise GraphError(f"graph '{self.name}': a node name must be a non-empty string, got {node.name!r}.")
        if node.name in self.nodes:
            raise GraphError(f"node '{node.name}' is declared twice in graph '{self.name}'.")
        self.nodes[node.name] = node
        return node.name

    def generate(
        self,
        name: str,
        *,
        model: str,
        reads: Iterable[str] | str = ("prompts",),
        writes: Iterable[str] | str = ("responses",),
        n: int = 1,
        greedy: bool = False,
        **options: Any,
    ) -> str:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
            raise GraphError(f"node '{name}': n must be >= 1 and <= {MAX_SAMPLES} (a whole number), got {n!r}.")
        return self._add(
            Generate(
                name=name,
                model=model,
                reads=_keys(reads, "read", name),
                writes=_keys(writes, "write", name),
                n=n,
                greedy=greedy,
                options=options,
            )
        )

    def forward(
        self,
        name: str,
        *,
        model: str,
        output: ForwardOutput,
        reads: Iterable[str] | str = ("responses",),
        writes: Iterable[str] | str,
        **options: Any,
    ) -> str:
        if output not in ("logprobs", "values", "scores"):
            raise GraphError(f"node '{name}': forward output must be logprobs, values or scores, got {output!r}.")
        return self._add(
            Forward(
                name=name,
                model=model,
                output=output,
                reads=_keys(reads, "read", name),
                writes=_keys(writes, "write", name),
                options=options,
            )
        )

    def reward(
        self,
        name: str,
        *,
        fn: str,
        reads: Iterable[str] | str = ("prompts", "responses"),
        writes: Iterable[str] | str = ("rewards",),
        **options: Any,
    ) -> str:
        return self._add(
            Reward(
                name=name, fn=fn, reads=_keys(reads, "read", name), writes=_keys(writes, "write", name), options=options
            )
        )

    def compute(
        self, name: str, *, fn: str, reads: Iterable[str] | str, writes: Iterable[str] | str, **options: Any
    ) -> str:
        return self._add(
            Compute(
                name=name, fn=fn, reads=_keys(reads, "read", name), writes=_keys(writes, "write", name), options=options
            )
        )

    def train(
        self,
        name: str,
        *,
        model: str,
        loss: str,
        reads: Iterable[str] | str,
        writes: Iterable[str] | str = (),
        **options: Any,
    ) -> str:
        return self._add(
            Train(
                name=name,
                model=model,
                loss=loss,
                reads=_keys(reads, "read", name),
                writes=_keys(writes, "write", name),
                options=options,
            )
        )

    # ---------------------------------------------------------------- derived structure
    def spec(self) -> GraphSpec:
        return GraphSpec(
            name=self.name, inputs=self.inputs, models=tuple(self.models.values()), nodes=tuple(self.nodes.values())
        )

    def fingerprint(self) -> str:
        """A content hash of the graph (stable across runs and processes)."""
        return hashlib.sha256(msgspec.json.encode(self.spec(), order="sorted")).hexdigest()[:16]

    def producers(self) -> dict[str, list[str]]:
        """key -> nodes writing it."""
        out: dict[str, list[str]] = {}
        for node in self.nodes.values():
            for key in node.writes:
                out.setdefault(key, []).append(node.name)
        return out

    def train_nodes(self, model: str) -> list[str]:
        return [n.name for n in self.nodes.values() if isinstance(n, Train) and n.model == model]

    def dag(self) -> nx.DiGraph:
        """Nodes and per-iteration edges. Edge attrs: keys (data) and/or version (model name)."""
        g = nx.DiGraph()
        for node in self.nodes.values():
            g.add_node(node.name)
        producers = self.producers()
        for node in self.nodes.values():
            for key in node.reads:
                for src in producers.get(key, ()):
                    if src == node.name:
                        continue
                    g.add_edge(src, node.name)
                    g.edges[src, node.name].setdefault("keys", []).append(key)
        for node in self.nodes.values():
            if node.model is None or isinstance(node, Train):
                continue
            for t in self.train_nodes(node.model):
                if not g.has_edge(node.name, t):
                    g.add_edge(node.name, t)
                g.edges[node.name, t]["version"] = node.model
        return g

    def loop_edges(self) -> list[tuple[str, str, str]]:
        """(train node, generate node, model): next iteration's generate reads model@v+1."""
        out = []
        for node in self.nodes.values():
            if isinstance(node, Generate):
                out.extend((t, node.name, node.model) for t in self.train_nodes(node.model))
        return out

    def order(self) -> list[str]:
        """A deterministic topological order (ties broken by declaration order)."""
        index = {name: i for i, name in enumerate(self.nodes)}
        return list(nx.lexicographical_topological_sort(self.dag(), key=index.__getitem__))

    def stages(self) -> list[list[str]]:
        """Groups of nodes with no path between them: each group can run in parallel."""
        index = {name: i for i, name in enumerate(self.nodes)}
        return [sorted(gen, key=index.__getitem__) for gen in nx.topological_generations(self.dag())]

    # ---------------------------------------------------------------- invariants
    def _fail(self, message: str, node: str | None = None) -> GraphError:
        from flowrl.graph.printer import neighbourhood

        context = neighbourhood(self, node) if node else ""
        return GraphError(message + (f"\n{context}" if context else ""))

    def verify(self) -> Graph:
        """Check every invariant; raise GraphError naming the node and key at fault."""
        if not self.nodes:
            raise GraphError(f"graph '{self.name}' has no nodes.")
        for decl in self.models.values():
            if decl.init_from is not None and decl.init_from not in self.models:
                raise GraphError(
                    f"model '{decl.name}' initialises from '{decl.init_from}', which is not a declared model "
                    f"({_known(self.models)})."
                )
        self._check_init_cycles()
        for node in self.nodes.values():
            self._check_node_model(node)
        producers = self.producers()
        for key, nodes in producers.items():
            if len(nodes) > 1:
                raise self._fail(
                    f"key '{key}' has two producers: nodes '{nodes[0]}' and '{nodes[1]}' both write it. Give "
                    "one of them another key name.",
                    nodes[1],
                )
            if key in self.inputs:
                raise self._fail(
                    f"node '{nodes[0]}' writes '{key}', which is a graph input; inputs are read-only.", nodes[0]
                )
        for node in self.nodes.values():
            for key in set(node.reads) & set(node.writes):
                raise self._fail(
                    f"node '{node.name}' reads and writes key '{key}'; a key cannot depend on itself within an "
                    "iteration. Write the new value under another key name.",
                    node.name,
                )
            for key in node.reads:
                if key not in producers and key not in self.inputs:
                    did = did_you_mean(key, [*producers, *self.inputs])
                    raise self._fail(
                        f"node '{node.name}' reads key '{key}', which no node writes and is not a graph input "
                        f"({', '.join(self.inputs)}).{did}",
                        node.name,
                    )
            if not node.writes and not isinstance(node, Train):
                raise self._fail(f"node '{node.name}' writes no keys, so nothing can use its result.", node.name)
        self._check_arity()
        for decl in self.models.values():
            trains = self.train_nodes(decl.name)
            if decl.trainable and not trains:
                raise GraphError(
                    f"model '{decl.name}' is trainable but no train node updates it. Add g.train(..., "
                    f"model='{decl.name}') or declare it trainable=False."
                )
            if len(trains) > 1:
                raise self._fail(
                    f"model '{decl.name}' has two train nodes ('{trains[0]}', '{trains[1]}'); one train node "
                    "per model and iteration.",
                    trains[1],
                )
        dag = self.dag()
        try:
            cycle = nx.find_cycle(dag)
        except nx.NetworkXNoCycle:
            return self
        raise self._fail(_describe_cycle(dag, cycle), cycle[0][0])

    def sequence_keys(self) -> set[str]:
        """Keys holding generated responses: the first key each generate node writes."""
        return {n.writes[0] for n in self.nodes.values() if isinstance(n, Generate) and n.writes}

    def _check_arity(self) -> None:
        """How many keys each node kind reads and writes, and which of them hold responses."""
        seqs = self.sequence_keys()
        for node in self.nodes.values():
            read_seqs = [k for k in node.reads if k in seqs]
            problem = None
            if isinstance(node, Generate):
                if len(node.reads) != 1 or read_seqs:
                    problem = f"reads {list(node.reads)}; a generate node reads exactly one key of prompts"
                elif len(node.writes) > 2:
                    problem = (
                        f"writes {list(node.writes)}; a generate node writes responses and, optionally, their log-probs"
                    )
            elif isinstance(node, Forward) and len(node.writes) != 1:
                problem = f"writes {list(node.writes)}; a forward node writes exactly one key (its {node.output})"
            elif isinstance(node, Reward) and len(node.writes) != 1:
                problem = f"writes {list(node.writes)}; a reward node writes exactly one key (the scores)"
            elif isinstance(node, Train) and len(node.writes) > 1:
                problem = f"writes {list(node.writes)}; a train node writes at most one key (its stats)"
            if problem is None and isinstance(node, (Forward, Reward, Train)) and len(read_seqs) != 1:
                problem = (
                    f"reads {len(read_seqs)} keys of generated responses "
                    f"({', '.join(read_seqs) or 'none'}); it needs exactly one, e.g. 'responses'"
                )
            if problem is None and isinstance(node, Reward) and not any(k in self.inputs for k in node.reads):
                problem = (
                    "reads no prompts; a reward node scores responses against their prompts (add "
                    "'prompts' to its reads)"
                )
            if problem is not None:
                raise self._fail(f"node '{node.name}' {problem}.", node.name)

    def _check_init_cycles(self) -> None:
        for decl in self.models.values():
            seen = [decl.name]
            cur = decl.init_from
            while cur is not None:
                if cur in seen:
                    raise GraphError(f"models initialise from each other in a cycle: {' <- '.join([*seen, cur])}.")
                seen.append(cur)
                cur = self.models[cur].init_from

    def _check_node_model(self, node: Node) -> None:
        if node.model is None:
            return
        decl = self.models.get(node.model)
        if decl is None:
            raise self._fail(
                f"node '{node.name}' runs on model '{node.model}', which is not declared "
                f"({_known(self.models)}). Add g.model('{node.model}', ...).",
                node.name,
            )
        if isinstance(node, Train) and not decl.trainable:
            raise self._fail(
                f"node '{node.name}' trains model '{decl.name}', which is frozen (role {decl.role}). Declare "
                "it trainable=True or remove the train node.",
                node.name,
            )
        if isinstance(node, Generate) and decl.scalar_head:
            raise self._fail(
                f"node '{node.name}' generates with model '{decl.name}', a {decl.role} model with a scalar "
                "head; generate needs an actor or reference model.",
                node.name,
            )
        if isinstance(node, Forward):
            need_scalar = node.output in ("values", "scores")
            if need_scalar != decl.scalar_head:
                want = "a critic, reward or cost model" if need_scalar else "an actor or reference model"
                raise self._fail(
                    f"node '{node.name}' asks model '{decl.name}' (role {decl.role}) for {node.output}; that "
                    f"needs {want}.",
                    node.name,
                )


def streamed_nodes(graph: Graph) -> set[str]:
    """Nodes that can run on parts of a step's responses while generation goes on (streaming):
    reward and forward (scoring) nodes that read what generation writes and otherwise only graph
    inputs and what other such nodes write."""
    gen_keys = {k for n in graph.nodes.values() if isinstance(n, Generate) for k in n.writes}
    known = set(graph.inputs) | gen_keys
    out: set[str] = set()
    for name in graph.order():
        node = graph.nodes[name]
        if isinstance(node, (Forward, Reward)) and set(node.reads) <= known and set(node.reads) - set(graph.inputs):
            out.add(name)
            known |= set(node.writes)
    return out


def _known(models: dict[str, ModelDecl]) -> str:
    return "declared: " + (", ".join(models) if models else "none")


def _describe_cycle(dag: nx.DiGraph, cycle: list[tuple[str, str]]) -> str:
    parts = []
    for u, v in cycle:
        data = dag.edges[u, v]
        via = ", ".join(data.get("keys", [])) or f"{data['version']}@v must be read before it is trained"
        parts.append(f"'{u}' -> '{v}' (via {via})")
    return (
        "the graph has a cycle within one iteration: "
        + "; ".join(parts)
        + ". A key cannot depend on itself; use a new key name for the later value."
    )
