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
from typing import Any, ClassVar, Literal, get_args

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


class StateDecl(Spec):
    """Graph state: a named number that lives across iterations (a Lagrange multiplier, an
    adaptive KL coefficient, a running statistic). Every node of iteration k that reads it sees
    its value after iteration k-1; the one node that ``updates`` it writes the value for k+1.
    Saved in every checkpoint and restored on resume."""

    name: str
    value: float  # the initial value
    low: float | None = None  # the updated value is clamped to [low, high]
    high: float | None = None


class _Node(Spec, frozen=True, kw_only=True, tag_field="kind"):
    """The fields every node has. Each kind's class below is also its row of the graph layer's
    table of node kinds: the class-level facts here (overridden per kind) and the small methods
    are all that verify(), the edges, streaming and the printer ask of a kind. A new kind is one
    class here and a member of ``Node`` (plus its runner in flowrl/runtime/nodes.py and its
    lowering and costs in the planner)."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    options: dict[str, Any] = {}
    # port -> graph key: the function's named input or output ``port`` is the graph key ``key``
    # (unbound ports are the key of the same name), so one function serves any policy or critic
    ports: dict[str, str] = {}

    model: str | None = None  # overridden where a node runs on a model

    #: It samples responses to one key of prompts (its only read): its first write holds them, the
    #: rows of an iteration start here, and the next iteration's run reads the trained weights.
    samples: ClassVar[bool] = False
    #: Its first write holds responses to one key of prompts (its only read): a generate node's, or a
    #: source's read from the data. The rows of an iteration start here.
    starts_rows: ClassVar[bool] = False
    #: It updates its model's weights (model@v -> v+1); every other node on the model runs first.
    trains: ClassVar[bool] = False
    #: It drops rows: every node after it sees only the rows it keeps.
    keeps_rows: ClassVar[bool] = False
    #: What it produces besides keys ("weights", "rows"); None: only keys or state, so it must write some.
    effect: ClassVar[str | None] = None
    #: How many keys it writes (fewest, most), and what they are (str.format with node=the node), for
    #: the message when the count is wrong; None: any number.
    write_count: ClassVar[tuple[int, int] | None] = None
    writes_doc: ClassVar[str] = ""
    #: It reads exactly one key of generated responses.
    reads_sequences: ClassVar[bool] = False
    #: It also reads the prompts its responses answer (and no other prompts).
    reads_prompts: ClassVar[bool] = False
    #: It passes graph state to its function; if not, why it cannot read state.
    reads_state: ClassVar[bool] = False
    no_state_because: ClassVar[str] = "only compute and train nodes pass state to their functions"
    #: It may run between a generate node and its filter: again in every dynamic-sampling round.
    in_sampling_rounds: ClassVar[bool] = False
    #: It may run on parts of a step's responses while generation goes on (streaming).
    streams: ClassVar[bool] = False
    #: How the drawings show it (graphviz shape, matplotlib colour).
    dot_shape: ClassVar[str] = "box"
    color: ClassVar[str] = "#bde0fe"

    @property
    def kind(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[attr-defined]

    @property
    def updated_states(self) -> tuple[str, ...]:
        """The graph state it writes for the next iteration."""
        return ()

    def model_problem(self, decl: ModelDecl) -> str | None:
        """Why ``decl`` (the model it runs on) cannot run this node, or None."""
        return None

    def label(self) -> str:
        """What it runs, as the printer shows it: its model at version v, or its function."""
        return f"{self.model}@v" if self.model is not None else ""

    def details(self) -> list[str]:
        """Its kind's settings, as the printer shows them."""
        return []


class Generate(_Node, frozen=True, tag="generate"):
    """Sample `n` responses per prompt from `model` (greedy=True: one argmax response). With
    `env`, each response is an episode of up to `turns` model turns, the environment answering
    after each; with `agent`, an episode of the user's agent, whose up to `turns` requests to the
    run's OpenAI-compatible endpoint are its model turns (`flowrl.runtime.agents`). Only the
    model's tokens are trained."""

    model: str
    n: int = 1
    greedy: bool = False
    env: str | None = None
    turns: int = 1
    turn_tokens: int | None = None  # model tokens per turn (None: the response budget over the turns)
    env_tokens: int | None = None  # environment text per episode (None: within the response budget)
    agent: str | None = None  # a registered agent, or 'module:function' / 'file.py:function'
    timeout: float = 120.0  # an agent's own seconds per episode (waiting on the endpoint not counted)
    concurrency: int = 64  # agent episodes running at once
    failure_reward: float = 0.0  # the reward of an episode whose agent raised, timed out or gave no number

    @property
    def multi_turn(self) -> bool:
        """Whether each response is an episode of several turns (an environment's or an agent's)."""
        return self.env is not None or self.agent is not None

    samples = True
    starts_rows = True
    write_count = (1, 2)
    writes_doc = "responses and, optionally, their log-probs"
    color = "#8ecae6"

    def model_problem(self, decl: ModelDecl) -> str | None:
        if decl.scalar_head:
            return (
                f"node '{self.name}' generates with model '{decl.name}', a {decl.role} model with a scalar "
                "head; generate needs an actor or reference model."
            )
        return None

    def details(self) -> list[str]:
        parts = [f"n={self.n}"]
        if self.greedy:
            parts.append("greedy")
        if self.agent is not None:
            parts.append(f"agent={self.agent} turns={self.turns} timeout={self.timeout:g}s")
        if self.env is not None:
            parts.append(f"env={self.env} turns={self.turns}")
            if self.turn_tokens is not None:
                parts.append(f"turn_tokens={self.turn_tokens}")
            if self.env_tokens is not None:
                parts.append(f"env_tokens={self.env_tokens}")
        return parts


SourceRows = Literal["sft", "pairs"]


class Source(_Node, frozen=True, tag="source"):
    """Read the responses to one key of prompts from the data instead of generating them (offline
    rows: `flowrl.runtime.offline`). ``rows="sft"``: one row per prompt, its demonstration (a
    response column, or a conversation's turns from the first assistant turn on); ``rows="pairs"``:
    two rows per prompt, the chosen response then the rejected one (a group of two, as a generate
    node's ``n=2``). Only the assistant's tokens are trained. Runs on the controller, no model."""

    rows: SourceRows = "sft"

    starts_rows = True
    write_count = (1, 1)
    writes_doc = "exactly one key (the responses)"
    dot_shape = "cylinder"
    color = "#a8dadc"

    @property
    def per_prompt(self) -> int:
        """Rows per prompt."""
        return 2 if self.rows == "pairs" else 1

    def label(self) -> str:
        return "data"

    def details(self) -> list[str]:
        return [f"rows={self.rows}"]


class Forward(_Node, frozen=True, tag="forward"):
    """Score given sequences with `model`: token log-probs, token values, or a scalar score."""

    model: str
    output: ForwardOutput

    write_count = (1, 1)
    writes_doc = "exactly one key (its {node.output})"
    reads_sequences = True
    streams = True

    def model_problem(self, decl: ModelDecl) -> str | None:
        need_scalar = self.output in ("values", "scores")
        if need_scalar != decl.scalar_head:
            want = "a critic, reward or cost model" if need_scalar else "an actor or reference model"
            return (
                f"node '{self.name}' asks model '{decl.name}' (role {decl.role}) for {self.output}; that needs {want}."
            )
        return None

    def details(self) -> list[str]:
        return [f"output={self.output}"]


class _Function(_Node, frozen=True):
    """A node that runs a registered function `fn` on the controller (no model)."""

    fn: str

    def label(self) -> str:
        return super().label() or f"fn={self.fn}"


class Reward(_Function, frozen=True, tag="reward"):
    """A rule-based reward function `fn` (a registered reward function)."""

    write_count = (1, 1)
    writes_doc = "exactly one key (the scores)"
    reads_sequences = True
    reads_prompts = True
    in_sampling_rounds = True
    streams = True
    dot_shape = "diamond"
    color = "#ffb703"


class Compute(_Function, frozen=True, tag="compute"):
    """A compute function `fn` on keys (advantages, reward shaping); it may also
    update graph state (`updates`): its function returns the state's new value under its name."""

    updates: tuple[str, ...] = ()

    reads_state = True
    in_sampling_rounds = True
    dot_shape = "ellipse"
    color = "#cdeac0"

    @property
    def updated_states(self) -> tuple[str, ...]:
        return self.updates

    def details(self) -> list[str]:
        return [f"updates={','.join(self.updates)}"] if self.updates else []


class Filter(_Function, frozen=True, tag="filter"):
    """Keep what `fn` accepts; every node after it sees only the kept rows. By default whole groups
    (all samples of one prompt; a group stays when `fn` accepts it, or all its rows); `by_row`:
    single rows (a group passes when any of its rows does; its other rows are dropped). Dynamic
    sampling: with `groups` N, generation samples more prompts until N groups passed, at most
    `max_rounds` rounds; the batch holds the first N that passed."""

    groups: int | None = None  # None: the step's prompts_per_step
    max_rounds: int = 1
    by_row: bool = False

    keeps_rows = True
    effect = "rows"
    reads_sequences = True
    no_state_because = "a filter runs inside generation, ahead of training, where state is not settled"
    dot_shape = "invtrapezium"
    color = "#f4a261"

    def details(self) -> list[str]:
        keeps = " by_row" if self.by_row else ""
        return [f"groups={self.groups or 'prompts_per_step'} max_rounds={self.max_rounds}{keeps}"]


class Train(_Node, frozen=True, tag="train"):
    """Update `model` with `loss`; produces model@v+1."""

    model: str
    loss: str

    trains = True
    effect = "weights"
    write_count = (0, 1)
    writes_doc = "at most one key (its stats)"
    reads_sequences = True
    reads_state = True
    dot_shape = "doubleoctagon"
    color = "#fb8500"

    def model_problem(self, decl: ModelDecl) -> str | None:
        if not decl.trainable:
            return (
                f"node '{self.name}' trains model '{decl.name}', which is frozen (role {decl.role}). Declare "
                "it trainable=True or remove the train node."
            )
        return None

    def label(self) -> str:
        return f"{self.model}@v->v+1"

    def details(self) -> list[str]:
        return [f"loss={self.loss}"]


Node = Generate | Source | Forward | Reward | Compute | Filter | Train
NODE_KINDS = tuple(kind.__struct_config__.tag for kind in get_args(Node))


class GraphSpec(Spec):
    """The serialisable form of a graph; its JSON encoding gives the fingerprint."""

    name: str
    inputs: tuple[str, ...]
    models: tuple[ModelDecl, ...]
    nodes: tuple[Node, ...]
    states: tuple[StateDecl, ...] = ()


def _ports(ports: dict[str, str] | None, node: str) -> dict[str, str]:
    if ports is None:
        return {}
    if not isinstance(ports, dict):
        raise GraphError(f"node '{node}': ports must be a dict of port name -> graph key, got {type(ports).__name__}.")
    for port, key in ports.items():
        for what, v in (("port", port), ("key", key)):
            if not isinstance(v, str) or not v.isidentifier():
                raise GraphError(f"node '{node}': ports {what} {v!r} is not a valid name (use identifiers).")
    return dict(ports)


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
        self.states: dict[str, StateDecl] = {}
        # set by the loader for a graph built from a file: (the file as a plugin, what it registers as
        # (kind, name, fn, meta)); a run puts them back in its registry (`Registry.claim`), so another
        # graph file loaded since never stands in for this graph's own functions
        self.file_functions: tuple[str, tuple[tuple[str, str, Any, dict[str, Any]], ...]] | None = None

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

    def state(self, name: str, value: float, *, low: float | None = None, high: float | None = None) -> str:
        """Declare graph state ``name`` starting at ``value`` (clamped to [low, high] when updated).
        Nodes read it like a key; one compute node ``updates`` it each iteration."""
        if not isinstance(name, str) or not name.isidentifier():
            raise GraphError(f"graph '{self.name}': state name {name!r} is not a valid name (use an identifier).")
        if name in self.states:
            raise GraphError(f"state '{name}' is declared twice in graph '{self.name}'.")
        for what, v in (("value", value), ("low", low), ("high", high)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v):
                raise GraphError(f"state '{name}': {what} must be a number, got {v!r}.")
        if low is not None and high is not None and low > high:
            raise GraphError(f"state '{name}': low {low} is above high {high}.")
        self.states[name] = StateDecl(
            name=name,
            value=float(value),
            low=None if low is None else float(low),
            high=None if high is None else float(high),
        )
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
        env: str | None = None,
        turns: int = 1,
        turn_tokens: int | None = None,
        env_tokens: int | None = None,
        agent: str | None = None,
        timeout: float = 120.0,
        concurrency: int = 64,
        failure_reward: float = 0.0,
        **options: Any,
    ) -> str:
        """Sample ``n`` responses per prompt. With ``env`` (a registered environment), each response
        is an episode: the model acts, the environment answers, for up to ``turns`` model turns of at
        most ``turn_tokens`` each (default: the response budget over the turns), with at most
        ``env_tokens`` of environment text (default: what the response budget leaves); a given
        ``env_tokens`` makes the response budget ``turns * turn_tokens + env_tokens``. ``options``
        then go to the environment.

        With ``agent`` (a registered agent, or ``'module:function'`` / ``'file.py:function'``), each
        response is an episode of the user's agent talking to the policy through the run's
        OpenAI-compatible endpoint: up to ``turns`` requests of at most ``turn_tokens`` each, at most
        ``concurrency`` episodes at once, ``timeout`` seconds of the agent's own time each; an agent
        that raises, times out or returns no number scores ``failure_reward``. ``options`` then go
        to the agent (`flowrl.agents`)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
            raise GraphError(f"node '{name}': n must be >= 1 and <= {MAX_SAMPLES} (a whole number), got {n!r}.")
        if env is not None and (not isinstance(env, str) or not env):
            raise GraphError(f"node '{name}': env must be the name of a registered environment, got {env!r}.")
        if isinstance(turns, bool) or not isinstance(turns, int) or not 1 <= turns <= 64:
            raise GraphError(f"node '{name}': turns must be a whole number in [1, 64], got {turns!r}.")
        if agent is not None and (not isinstance(agent, str) or not agent):
            raise GraphError(f"node '{name}': agent must name a registered agent or 'module:function', got {agent!r}.")
        if agent is not None and env is not None:
            raise GraphError(
                f"node '{name}': give env=NAME or agent=NAME, not both (an agent runs its own environment)."
            )
        if agent is not None and env_tokens is not None:
            raise GraphError(
                f"node '{name}': env_tokens is a budget of environment episodes; agent episodes share the "
                "response budget."
            )
        if agent is None:
            for key, value in (("timeout", timeout), ("concurrency", concurrency), ("failure_reward", failure_reward)):
                if value != {"timeout": 120.0, "concurrency": 64, "failure_reward": 0.0}[key]:
                    raise GraphError(f"node '{name}': {key} is a setting of agent episodes; it needs agent=NAME.")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise GraphError(f"node '{name}': timeout must be seconds in (0, 86400], got {timeout!r}.")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= 4096:
            raise GraphError(f"node '{name}': concurrency must be a whole number in [1, 4096], got {concurrency!r}.")
        if isinstance(failure_reward, bool) or not isinstance(failure_reward, (int, float)):
            raise GraphError(f"node '{name}': failure_reward must be a number, got {failure_reward!r}.")
        if turns > 1 and env is None and agent is None:
            raise GraphError(
                f"node '{name}': turns={turns} needs an environment or an agent to answer between turns "
                "(env=NAME or agent=NAME)."
            )
        for key, value in (("turn_tokens", turn_tokens), ("env_tokens", env_tokens)):
            if value is None:
                continue
            if env is None and (agent is None or key == "env_tokens"):
                raise GraphError(
                    f"node '{name}': {key} is a budget of multi-turn episodes; it needs env=NAME (or agent=NAME)."
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "turn_tokens" else 0):
                raise GraphError(
                    f"node '{name}': {key} must be a whole number >= {int(key == 'turn_tokens')}, got {value!r}."
                )
        if env_tokens is not None and turn_tokens is None:
            raise GraphError(f"node '{name}': env_tokens={env_tokens} needs turn_tokens (the model's budget per turn).")
        return self._add(
            Generate(
                name=name,
                model=model,
                reads=_keys(reads, "read", name),
                writes=_keys(writes, "write", name),
                n=n,
                greedy=greedy,
                env=env,
                turns=turns,
                turn_tokens=turn_tokens,
                env_tokens=env_tokens,
                agent=agent,
                timeout=float(timeout),
                concurrency=concurrency,
                failure_reward=float(failure_reward),
                options=options,
            )
        )

    def source(
        self,
        name: str,
        *,
        reads: Iterable[str] | str = ("prompts",),
        writes: Iterable[str] | str = ("responses",),
        rows: SourceRows = "sft",
    ) -> str:
        """Responses read from the data, not generated (supervised fine-tuning, preference pairs): for
        each prompt of ``reads``, its given response(s) as ``writes``, tokenized with the chat template
        and the assistant's tokens marked trained. ``rows``: ``sft`` (one demonstration per prompt) or
        ``pairs`` (chosen, then rejected)."""
        if rows not in get_args(SourceRows):
            raise GraphError(f"node '{name}': rows must be one of {', '.join(get_args(SourceRows))}, got {rows!r}.")
        return self._add(
            Source(name=name, reads=_keys(reads, "read", name), writes=_keys(writes, "write", name), rows=rows)
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

    def judge(
        self,
        name: str,
        *,
        model: str,
        template: str,
        reads: Iterable[str] | str = ("prompts", "responses"),
        writes: str = "rewards",
        pattern: str = r"(-?\d+(?:\.\d+)?)",
        scale: float = 1.0,
        default: float = 0.0,
    ) -> str:
        """Score responses with a judge model (LLM-as-judge): three nodes, as one would write them.
        ``NAME_prompts`` fills ``template`` (``{prompt}``, ``{response}``, ``{answer}``) for each
        response; ``NAME_generate`` has ``model`` (a frozen ``reference`` model, say) write one greedy
        verdict per prompt; ``NAME`` parses each verdict's score (``pattern``'s first group, divided by
        ``scale``; ``default`` where it finds none) into ``writes``, one per response."""
        keys = _keys(reads, "read", name)
        if len(keys) != 2:
            raise GraphError(f"node '{name}': a judge reads two keys, the prompts and the responses; got {keys}.")
        if not isinstance(template, str) or "{response}" not in template:
            raise GraphError(f"node '{name}': the judge's template must hold {{response}}, got {template!r}.")
        prompts, verdicts = f"{name}_prompts", f"{name}_verdicts"
        self.compute(
            prompts,
            fn="judge_prompts",
            reads=keys,
            writes=prompts,
            ports={"prompts": keys[0], "responses": keys[1], "judge_prompts": prompts},
            template=template,
        )
        self.generate(f"{name}_generate", model=model, reads=prompts, writes=verdicts, greedy=True)
        return self.compute(
            name,
            fn="judge_scores",
            reads=verdicts,
            writes=writes,
            ports={"verdicts": verdicts, "scores": writes},
            pattern=pattern,
            scale=scale,
            default=default,
        )

    def compute(
        self,
        name: str,
        *,
        fn: str,
        reads: Iterable[str] | str,
        writes: Iterable[str] | str = (),
        ports: dict[str, str] | None = None,
        updates: Iterable[str] | str = (),
        **options: Any,
    ) -> str:
        """Run compute function ``fn``. ``ports`` binds its named inputs and outputs to graph keys
        (``{"rewards": "costs", "advantages": "cost_advantages"}``); ``updates`` names graph state
        it writes for the next iteration."""
        return self._add(
            Compute(
                name=name,
                fn=fn,
                reads=_keys(reads, "read", name),
                writes=_keys(writes, "write", name),
                ports=_ports(ports, name),
                updates=_keys(updates, "state", name),
                options=options,
            )
        )

    def filter(
        self,
        name: str,
        *,
        fn: str,
        reads: Iterable[str] | str,
        groups: int | None = None,
        max_rounds: int = 1,
        by_row: bool = False,
        ports: dict[str, str] | None = None,
        **options: Any,
    ) -> str:
        """Keep the groups filter function ``fn`` accepts (``by_row``: the single rows it accepts).
        ``groups`` N and ``max_rounds`` K: dynamic sampling, generating more prompts until N groups
        passed, at most K rounds."""
        if not isinstance(by_row, bool):
            raise GraphError(f"node '{name}': by_row must be True or False, got {by_row!r}.")
        for what, v, low in (("groups", groups, 1), ("max_rounds", max_rounds, 1)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_SAMPLES):
                raise GraphError(f"node '{name}': {what} must be a whole number in [1, {MAX_SAMPLES}], got {v!r}.")
        return self._add(
            Filter(
                name=name,
                fn=fn,
                reads=_keys(reads, "read", name),
                writes=(),
                groups=groups,
                max_rounds=max_rounds,
                by_row=by_row,
                ports=_ports(ports, name),
                options=options,
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
        ports: dict[str, str] | None = None,
        **options: Any,
    ) -> str:
        """Update ``model`` with ``loss``; ``ports`` binds the loss's inputs to graph keys."""
        return self._add(
            Train(
                name=name,
                model=model,
                loss=loss,
                reads=_keys(reads, "read", name),
                writes=_keys(writes, "write", name),
                ports=_ports(ports, name),
                options=options,
            )
        )

    # ---------------------------------------------------------------- derived structure
    def spec(self) -> GraphSpec:
        return GraphSpec(
            name=self.name,
            inputs=self.inputs,
            models=tuple(self.models.values()),
            nodes=tuple(self.nodes.values()),
            states=tuple(self.states.values()),
        )

    def fingerprint(self) -> str:
        """A content hash of the graph (stable across runs and processes)."""
        body = msgspec.to_builtins(self.spec())
        later = {"turn_tokens": None, "env_tokens": None, "agent": None, "timeout": 120.0, "concurrency": 64}
        later["failure_reward"] = 0.0
        for node in body["nodes"]:  # fields added later, left at their defaults: graphs keep their fingerprints
            for key, default in later.items():
                if node.get("kind") == "generate" and key in node and node[key] == default:
                    node.pop(key)
        return hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()[:16]

    def producers(self) -> dict[str, list[str]]:
        """key -> nodes writing it."""
        out: dict[str, list[str]] = {}
        for node in self.nodes.values():
            for key in node.writes:
                out.setdefault(key, []).append(node.name)
        return out

    def train_nodes(self, model: str) -> list[str]:
        return [n.name for n in self.nodes.values() if n.trains and n.model == model]

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
            if node.model is None or node.trains:
                continue
            for t in self.train_nodes(node.model):
                if not g.has_edge(node.name, t):
                    g.add_edge(node.name, t)
                g.edges[node.name, t]["version"] = node.model
        for state, updater in self.state_updaters().items():
            for node in self.nodes.values():
                if state in node.reads and node.name != updater:
                    if not g.has_edge(node.name, updater):
                        g.add_edge(node.name, updater)
                    g.edges[node.name, updater]["state"] = state
        for f in [n for n in self.nodes.values() if n.keeps_rows]:
            if f.name not in g:
                continue
            segment = nx.ancestors(g, f.name)
            for gen in [n for n in segment if self.nodes[n].samples]:
                for v in nx.descendants(g, gen) - segment - {f.name}:
                    if not nx.has_path(g, v, f.name) and not g.has_edge(f.name, v):
                        g.add_edge(f.name, v)
                        g.edges[f.name, v]["rows"] = f.name
        return g

    def state_updaters(self) -> dict[str, str]:
        """state -> the node that updates it."""
        return {s: n.name for n in self.nodes.values() for s in n.updated_states}

    def filter_segment(self, name: str) -> tuple[str, list[str]]:
        """Filter ``name``'s generate node and the nodes between them (in run order): what runs in
        each dynamic-sampling round."""
        dag = self.dag()
        ancestors = nx.ancestors(dag, name)
        gens = [n for n in self.order() if n in ancestors and self.nodes[n].samples]
        between = [n for n in self.order() if n in ancestors and n not in gens]
        return gens[0], between

    def filters(self) -> dict[str, str]:
        """generate node -> the filter of its rows."""
        out = {}
        for node in self.nodes.values():
            if node.keeps_rows:
                out[self.filter_segment(node.name)[0]] = node.name
        return out

    def loop_edges(self) -> list[tuple[str, str, str]]:
        """(train node, generate node, model): next iteration's generate reads model@v+1."""
        out = []
        for node in self.nodes.values():
            if node.samples:
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
                if key not in producers and key not in self.inputs and key not in self.states:
                    did = did_you_mean(key, [*producers, *self.inputs, *self.states])
                    raise self._fail(
                        f"node '{node.name}' reads key '{key}', which no node writes and is not a graph input "
                        f"({', '.join(self.inputs)}) or state.{did}",
                        node.name,
                    )
            if not node.writes and not node.updated_states and node.effect is None:
                raise self._fail(f"node '{node.name}' writes no keys, so nothing can use its result.", node.name)
            self._check_ports(node, node.updated_states)
        self._check_states(producers)
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
            self._check_filters()
            return self
        raise self._fail(_describe_cycle(dag, cycle), cycle[0][0])

    def _check_ports(self, node: Node, updates: tuple[str, ...]) -> None:
        for port, key in node.ports.items():
            if key not in node.reads and key not in node.writes and key not in updates:
                raise self._fail(
                    f"node '{node.name}': port '{port}' is bound to key '{key}', which the node neither reads nor "
                    f"writes (reads: {', '.join(node.reads) or 'none'}; writes: {', '.join(node.writes) or 'none'}).",
                    node.name,
                )
        keys = list(node.ports.values())
        for key in keys:
            if keys.count(key) > 1:
                ports = [p for p, k in node.ports.items() if k == key]
                raise self._fail(
                    f"node '{node.name}': ports {', '.join(map(repr, ports))} are all bound to key '{key}'; bind each "
                    "key to one port.",
                    node.name,
                )
        for port, key in node.ports.items():
            if port != key and port in node.reads and port not in node.ports.values():
                raise self._fail(
                    f"node '{node.name}': port '{port}' is bound to key '{key}', but the node also reads key "
                    f"'{port}', which would reach the function under the same port name; bind key '{port}' to "
                    "another port, or stop reading it.",
                    node.name,
                )

    def _check_states(self, producers: dict[str, list[str]]) -> None:
        for name in self.states:
            if name in producers or name in self.inputs:
                what = "a graph input" if name in self.inputs else f"a key node '{producers[name][0]}' writes"
                raise GraphError(f"state '{name}' has the name of {what}; give the state another name.")
            if name in self.models:
                raise GraphError(f"state '{name}' has the name of a model; give the state another name.")
        seen: dict[str, str] = {}
        for node in self.nodes.values():
            for key in node.reads:
                if key in self.states and node.samples:
                    raise self._fail(
                        f"node '{node.name}' reads state '{key}'; a {node.kind} node reads exactly one key of prompts.",
                        node.name,
                    )
                if key in self.states and not node.reads_state:
                    raise self._fail(
                        f"node '{node.name}' ({node.kind}) reads state '{key}'; {node.no_state_because}. Read it in "
                        "a compute node.",
                        node.name,
                    )
            for name in node.updated_states:
                if name not in self.states:
                    did = did_you_mean(name, list(self.states))
                    raise self._fail(
                        f"node '{node.name}' updates state '{name}', which is not declared "
                        f"(declared: {', '.join(self.states) or 'none'}).{did} Add g.state('{name}', VALUE).",
                        node.name,
                    )
                if name in seen:
                    raise self._fail(
                        f"state '{name}' is updated by two nodes ('{seen[name]}', '{node.name}'); one node updates "
                        "a state per iteration.",
                        node.name,
                    )
                seen[name] = node.name

    def _check_filters(self) -> None:
        """A filter keeps groups of one generate node's rows; in each dynamic-sampling round its
        generate node and the nodes between them run again, so those are rule-based (reward,
        compute) nodes that do not read state."""
        gens: dict[str, str] = {}
        for node in self.nodes.values():
            if not node.keeps_rows:
                continue
            if not any(self.nodes[n].samples for n in nx.ancestors(self.dag(), node.name)):
                raise self._fail(
                    f"filter '{node.name}' keeps rows of no generate node; a filter keeps groups that generation "
                    "samples (rows read from the data are chosen in the data).",
                    node.name,
                )
            gen, between = self.filter_segment(node.name)
            if gen in gens:
                raise self._fail(
                    f"generate node '{gen}' has two filters ('{gens[gen]}', '{node.name}'); combine them into one "
                    "filter function.",
                    node.name,
                )
            gens[gen] = node.name
            dag = self.dag()
            others = [n for n in nx.ancestors(dag, node.name) if self.nodes[n].samples and n != gen]
            if others:
                raise self._fail(
                    f"filter '{node.name}' reads rows of two generate nodes ('{gen}', '{others[0]}'); a filter keeps "
                    "groups of one generate node.",
                    node.name,
                )
            for name in between:
                inner = self.nodes[name]
                if not inner.in_sampling_rounds:
                    raise self._fail(
                        f"filter '{node.name}' depends on {inner.kind} node '{name}'; what a filter reads is computed "
                        "again in every dynamic-sampling round, inside generation, so it must come from reward and "
                        "compute nodes (score with a reward model after the filter instead).",
                        node.name,
                    )
                stateful = [k for k in inner.reads if k in self.states]
                if stateful or inner.updated_states:
                    raise self._fail(
                        f"filter '{node.name}' depends on node '{name}', which reads or updates graph state; nodes "
                        "before a filter run during generation, ahead of training, where state is not settled.",
                        node.name,
                    )

    def sequence_keys(self) -> set[str]:
        """Keys holding responses: the first key each generate node writes, and what each source
        reads from the data."""
        return {n.writes[0] for n in self.nodes.values() if n.starts_rows and n.writes}

    def sources(self) -> list[Source]:
        """The nodes that read responses from the data (offline rows)."""
        return [n for n in self.nodes.values() if isinstance(n, Source)]

    def _check_arity(self) -> None:
        """How many keys each node kind reads and writes, and which of them hold responses."""
        seqs = self.sequence_keys()
        for node in self.nodes.values():
            read_seqs = [k for k in node.reads if k in seqs]
            problem = None
            if node.starts_rows and (len(node.reads) != 1 or read_seqs):
                problem = f"reads {list(node.reads)}; a {node.kind} node reads exactly one key of prompts"
            elif node.write_count is not None and not node.write_count[0] <= len(node.writes) <= node.write_count[1]:
                problem = f"writes {list(node.writes)}; a {node.kind} node writes {node.writes_doc.format(node=node)}"
            if problem is None and node.reads_sequences and len(read_seqs) != 1:
                problem = (
                    f"reads {len(read_seqs)} keys of generated responses "
                    f"({', '.join(read_seqs) or 'none'}); it needs exactly one, e.g. 'responses'"
                )
            prompt_keys = set(self.inputs) | {n.reads[0] for n in self.nodes.values() if n.starts_rows and n.reads}
            if problem is None and node.reads_prompts and read_seqs:
                gen = next(n for n in self.nodes.values() if n.starts_rows and read_seqs[0] in n.writes)
                other = [k for k in node.reads if k in prompt_keys and k != gen.reads[0]]
                if other and gen.reads:
                    problem = (
                        f"reads prompts '{other[0]}', but its responses '{read_seqs[0]}' answer the prompts "
                        f"'{gen.reads[0]}' ({gen.kind} node '{gen.name}'); read '{gen.reads[0]}' instead"
                    )
            if problem is None and node.reads_prompts and not any(k in prompt_keys for k in node.reads):
                problem = (
                    f"reads no prompts; a {node.kind} node scores responses against their prompts (add 'prompts' "
                    "to its reads)"
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
        problem = node.model_problem(decl)
        if problem is not None:
            raise self._fail(problem, node.name)


def streamed_nodes(graph: Graph) -> set[str]:
    """Nodes that can run on parts of a step's responses while generation goes on (streaming):
    reward and forward (scoring) nodes that read what generation writes and otherwise only graph
    inputs and what other such nodes write."""
    gen_keys = {k for n in graph.nodes.values() if n.samples for k in n.writes}
    known = set(graph.inputs) | gen_keys
    out: set[str] = set()
    for name in graph.order():
        node = graph.nodes[name]
        if node.streams and set(node.reads) <= known and set(node.reads) - set(graph.inputs):
            out.add(name)
            known |= set(node.writes)
    return out


def _known(models: dict[str, ModelDecl]) -> str:
    return "declared: " + (", ".join(models) if models else "none")


def _describe_cycle(dag: nx.DiGraph, cycle: list[tuple[str, str]]) -> str:
    parts = []
    for u, v in cycle:
        data = dag.edges[u, v]
        via = ", ".join(data.get("keys", []))
        if not via and "version" in data:
            via = f"{data['version']}@v must be read before it is trained"
        elif not via and "state" in data:
            via = f"state {data['state']} is read before it is updated"
        elif not via:
            via = f"the rows filter '{data['rows']}' keeps"
        parts.append(f"'{u}' -> '{v}' (via {via})")
    return (
        "the graph has a cycle within one iteration: "
        + "; ".join(parts)
        + ". A key cannot depend on itself; use a new key name for the later value."
    )
