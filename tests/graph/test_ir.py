"""Graph IR: derived edges, stages, invariants (verify) and fingerprints."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import msgspec
import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.errors import GraphError
from flowrl.graph import Graph, GraphSpec
from flowrl.graph.ir import Compute, Generate, Train
from flowrl.graphs import grpo, ppo, reinforce_pp, remax, rloo
from flowrl.specs import RunConfig

BUILTIN = {"ppo": ppo, "grpo": grpo, "remax": remax, "rloo": rloo, "reinforce_pp": reinforce_pp}


def build(name: str, cfg: RunConfig | None = None) -> Graph:
    return BUILTIN[name].build(cfg or RunConfig())


def minimal() -> Graph:
    """The smallest valid actor-only graph (like rloo); error cases start from it."""
    g = Graph("mini")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="task", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g


# ---------------------------------------------------------------------------- built-in graphs


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_graphs_verify_and_are_named(name: str) -> None:
    g = build(name)
    assert g.verify() is g
    assert g.name == name
    # every trainable model has exactly one train node, and the graph is a DAG per iteration
    for decl in g.models.values():
        assert len(g.train_nodes(decl.name)) == (1 if decl.trainable else 0)
    assert nx.is_directed_acyclic_graph(g.dag())


def test_generate_n_comes_from_config() -> None:
    cfg = msgspec.structs.replace(
        RunConfig(), rollout=msgspec.structs.replace(RunConfig().rollout, samples_per_prompt=5)
    )
    g = build("grpo", cfg)
    rollout = g.nodes["rollout"]
    assert isinstance(rollout, Generate) and rollout.n == 5
    greedy = build("remax", cfg).nodes["greedy"]
    assert isinstance(greedy, Generate) and greedy.greedy and greedy.n == 1


# ---------------------------------------------------------------------------- edges


def test_data_edges_carry_the_key_names() -> None:
    dag = build("ppo").dag()
    assert dag.edges["rollout", "values"]["keys"] == ["responses"]
    assert dag.edges["values", "gae"]["keys"] == ["values"]
    assert dag.edges["gae", "train_critic"]["keys"] == ["returns"]
    assert dag.edges["gae", "train_actor"]["keys"] == ["advantages"]
    assert dag.edges["reward", "gae"]["keys"] == ["rewards"]
    # no edge for a key nobody reads from that producer
    assert not dag.has_edge("ref_logprobs", "train_actor")
    assert not dag.has_edge("reward", "train_actor")
    # graph inputs have no producer node, so they add no edges
    assert all("prompts" not in data.get("keys", []) for _, _, data in dag.edges(data=True))


def test_one_edge_lists_every_key_in_read_order() -> None:
    g = Graph("two_keys")
    g.compute("a", fn="f", reads="prompts", writes="x y z")
    g.compute("b", fn="f", reads="z x", writes="out")
    dag = g.dag()
    assert list(dag.edges) == [("a", "b")]
    assert dag.edges["a", "b"]["keys"] == ["z", "x"]
    assert "version" not in dag.edges["a", "b"]


def test_version_edges_order_users_of_a_model_before_its_train_node() -> None:
    dag = build("ppo").dag()
    # old_logprobs runs on actor@v: it must run before train_actor makes actor@v+1
    assert dag.edges["old_logprobs", "train_actor"]["version"] == "actor"
    assert dag.edges["old_logprobs", "train_actor"]["keys"] == ["old_logprobs"]
    assert dag.edges["values", "train_critic"]["version"] == "critic"
    # rollout both feeds train_actor (data) and must precede it (version)
    assert dag.edges["rollout", "train_actor"] == {"keys": ["responses"], "version": "actor"}
    # rollout -> train_critic is data only: rollout does not run on the critic
    assert "version" not in dag.edges["rollout", "train_critic"]
    # the frozen reference has no train node: no version edge out of ref_logprobs
    assert {v for _, v in dag.out_edges("ref_logprobs")} == {"gae"}
    # train nodes themselves get no version edges
    assert not dag.has_edge("train_actor", "train_critic") and not dag.has_edge("train_critic", "train_actor")


def test_pure_version_edge_when_no_key_flows() -> None:
    g = build("remax")
    dag = g.dag()
    # greedy shares no key with train_actor but samples from actor@v, so it must run first
    assert dag.edges["greedy", "train_actor"] == {"version": "actor"}
    order = g.order()
    assert order.index("greedy") < order.index("train_actor")


def test_version_edge_forces_order_against_declaration_order() -> None:
    g = Graph("late_user")
    g.model("actor", "actor")
    g.generate("rollout", model="actor")
    g.train("train_actor", model="actor", loss="ppo", reads="responses")
    g.forward("lp", model="actor", output="logprobs", reads="responses", writes="lp")  # declared after train
    g.verify()
    assert g.dag().edges["lp", "train_actor"] == {"version": "actor"}
    assert g.order() == ["rollout", "lp", "train_actor"]
    assert g.stages() == [["rollout"], ["lp"], ["train_actor"]]


def test_loop_edges_go_from_train_to_generate_and_stay_out_of_the_dag() -> None:
    g = build("ppo")
    assert g.loop_edges() == [("train_actor", "rollout", "actor")]
    assert not g.dag().has_edge("train_actor", "rollout")
    r = build("remax")
    assert sorted(r.loop_edges()) == [("train_actor", "greedy", "actor"), ("train_actor", "rollout", "actor")]
    # a generate on a frozen model has no loop edge
    f = Graph("frozen_gen")
    f.model("actor", "actor", trainable=False)
    f.generate("rollout", model="actor")
    assert f.verify().loop_edges() == []


def test_producers_and_train_nodes() -> None:
    g = build("ppo")
    producers = g.producers()
    assert producers["advantages"] == ["gae"] and producers["returns"] == ["gae"]
    assert "prompts" not in producers
    assert g.train_nodes("critic") == ["train_critic"]
    assert g.train_nodes("ref") == []


# ---------------------------------------------------------------------------- stages and order


def test_ppo_stages_put_the_four_scorers_together() -> None:
    g = build("ppo")
    stages = g.stages()
    assert stages == [
        ["rollout"],
        ["old_logprobs", "ref_logprobs", "values", "reward"],
        ["gae"],
        ["train_actor", "train_critic"],
    ]
    dag = g.dag()
    assert not dag.has_edge("ref_logprobs", "values") and not dag.has_edge("values", "ref_logprobs")
    for stage in stages:
        for a in stage:
            for b in stage:
                if a != b:
                    assert not nx.has_path(dag, a, b), (a, b)


def test_order_is_topological_and_breaks_ties_by_declaration() -> None:
    g = Graph("ties")
    g.compute("c", fn="f", reads="b_out", writes="c_out")
    g.compute("b", fn="f", reads="prompts", writes="b_out")
    g.compute("a", fn="f", reads="prompts", writes="a_out")
    # c is declared first but must wait for b; once b ran, the ready node declared
    # earliest goes next (c before a)
    assert g.order() == ["b", "c", "a"]
    assert g.stages() == [["b", "a"], ["c"]]
    assert build("ppo").order() == list(build("ppo").nodes)


@st.composite
def random_dags(draw: st.DrawFn) -> Graph:
    """Compute-only graphs where node i reads inputs or keys written by nodes < i."""
    n = draw(st.integers(1, 8))
    g = Graph("random", inputs=("prompts", "extra"))
    available = ["prompts", "extra"]
    names = [f"n{i}" for i in range(n)]
    order = draw(st.permutations(range(n)))  # declaration order differs from data order
    specs = []
    for i in range(n):
        reads = draw(st.lists(st.sampled_from(available), min_size=1, max_size=3, unique=True))
        writes = [f"k{i}_{j}" for j in range(draw(st.integers(1, 2)))]
        specs.append((names[i], reads, writes))
        available.extend(writes)
    for i in order:
        name, reads, writes = specs[i]
        g.compute(name, fn="f", reads=reads, writes=writes)
    return g


@settings(max_examples=60, deadline=None)
@given(random_dags())
@pytest.mark.slow
def test_derived_structure_is_consistent(g: Graph) -> None:
    g.verify()
    dag = g.dag()
    for u, v, data in dag.edges(data=True):
        expected = [k for k in g.nodes[v].reads if k in g.nodes[u].writes]
        assert data["keys"] == expected
    # every shared key has an edge
    for v in g.nodes.values():
        for u in g.nodes.values():
            if u is not v and set(u.writes) & set(v.reads):
                assert dag.has_edge(u.name, v.name)
    order = g.order()
    assert sorted(order) == sorted(g.nodes)
    pos = {n: i for i, n in enumerate(order)}
    assert all(pos[u] < pos[v] for u, v in dag.edges)
    stages = g.stages()
    assert sorted(n for s in stages for n in s) == sorted(g.nodes)
    stage_of = {n: i for i, s in enumerate(stages) for n in s}
    assert all(stage_of[u] < stage_of[v] for u, v in dag.edges)


# ---------------------------------------------------------------------------- verify errors


def _cycle(g: Graph) -> None:
    g.compute("a", fn="f", reads="responses y", writes="x")
    g.compute("b", fn="f", reads="x", writes="y")


def _version_cycle(g: Graph) -> None:
    # train writes stats which a forward on the same model reads: forward must be both
    # after train (data) and before it (version)
    g.nodes.pop("train_actor")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages", writes="stats")
    g.forward("lp_after", model="actor", output="logprobs", reads="responses stats", writes="lp_after")


def _typo(g: Graph) -> None:
    g.compute("whiten", fn="f", reads="advantges", writes="white")


def _unknown_key(g: Graph) -> None:
    g.compute("whiten", fn="f", reads="zzzzqq", writes="white")


def _two_producers(g: Graph) -> None:
    g.compute("advantages2", fn="rloo", reads="rewards responses", writes="advantages")


def _train_frozen(g: Graph) -> None:
    g.model("ref", "reference")
    g.train("train_ref", model="ref", loss="ppo", reads="responses old_logprobs advantages")


def _ref_values(g: Graph) -> None:
    g.model("ref", "reference")
    g.forward("ref_values", model="ref", output="values", reads="responses", writes="ref_values")


def _critic_logprobs(g: Graph) -> None:
    g.model("critic", "critic", trainable=False)
    g.forward("critic_lp", model="critic", output="logprobs", reads="responses", writes="critic_lp")


def _generate_critic(g: Graph) -> None:
    g.model("critic", "critic", trainable=False)
    g.generate("critic_rollout", model="critic", reads="prompts", writes="critic_responses")


def _no_train(g: Graph) -> None:
    g.model("critic", "critic")
    g.forward("values", model="critic", output="values", reads="responses", writes="values")


def _undeclared(g: Graph) -> None:
    g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")


def _init_undeclared(g: Graph) -> None:
    g.model("ref", "reference", init_from="ghost")


def _init_cycle(g: Graph) -> None:
    g.model("ref", "reference", init_from="ref2")
    g.model("ref2", "reference", init_from="ref")


def _init_self(g: Graph) -> None:
    g.model("ref", "reference", init_from="ref")


def _writes_input(g: Graph) -> None:
    g.compute("rewrite", fn="f", reads="responses", writes="prompts")


def _two_trains(g: Graph) -> None:
    g.train("train_again", model="actor", loss="ppo", reads="responses old_logprobs advantages")


def _writes_nothing(g: Graph) -> None:
    g.compute("sink", fn="f", reads="advantages", writes=())


CASES: dict[str, tuple[Callable[[Graph], None], tuple[str, ...]]] = {
    "cycle": (_cycle, ("cycle within one iteration", "'a' -> 'b' (via x)", "'b' -> 'a' (via y)")),
    "version_cycle": (
        _version_cycle,
        ("cycle", "'train_actor' -> 'lp_after' (via stats)", "'lp_after' -> 'train_actor'", "actor@v"),
    ),
    "typo": (_typo, ("node 'whiten'", "'advantges'", "Did you mean 'advantages'?")),
    "two_producers": (_two_producers, ("key 'advantages'", "'advantages'", "'advantages2'", "two producers")),
    "train_frozen": (_train_frozen, ("node 'train_ref'", "model 'ref'", "frozen")),
    "ref_values": (_ref_values, ("node 'ref_values'", "model 'ref'", "role reference", "values")),
    "critic_logprobs": (_critic_logprobs, ("node 'critic_lp'", "model 'critic'", "logprobs")),
    "generate_critic": (_generate_critic, ("node 'critic_rollout'", "model 'critic'", "scalar head")),
    "no_train": (_no_train, ("model 'critic'", "trainable but no train node")),
    "undeclared": (_undeclared, ("node 'ref_logprobs'", "model 'ref'", "not declared", "declared: actor")),
    "init_undeclared": (_init_undeclared, ("model 'ref'", "'ghost'", "not a declared model")),
    "init_cycle": (_init_cycle, ("cycle", "ref <- ref2 <- ref")),
    "init_self": (_init_self, ("cycle", "ref <- ref")),
    "writes_input": (_writes_input, ("node 'rewrite'", "'prompts'", "graph input")),
    "two_trains": (_two_trains, ("model 'actor'", "'train_actor'", "'train_again'")),
    "writes_nothing": (_writes_nothing, ("node 'sink'", "writes no keys")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_errors_name_the_node_and_the_key_or_model(case: str) -> None:
    mutate, expected = CASES[case]
    g = minimal()
    g.verify()  # the base is valid; the mutation breaks it
    mutate(g)
    with pytest.raises(GraphError) as info:
        g.verify()
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_unknown_key_without_close_match_gets_no_hint() -> None:
    g = minimal()
    _unknown_key(g)
    with pytest.raises(GraphError, match="node 'whiten' reads key 'zzzzqq'") as info:
        g.verify()
    assert "Did you mean" not in str(info.value)


def test_node_errors_show_the_neighbourhood() -> None:
    g = minimal()
    _typo(g)
    with pytest.raises(GraphError) as info:
        g.verify()
    lines = str(info.value).splitlines()
    marked = [line for line in lines if line.startswith("  > ")]
    assert len(marked) == 1 and "whiten" in marked[0]


def test_node_reading_its_own_output_is_a_cycle() -> None:
    g = minimal()
    g.compute("accumulate", fn="f", reads="rewards running", writes="running")
    with pytest.raises(GraphError) as info:
        g.verify()
    assert "accumulate" in str(info.value) and "running" in str(info.value)


def test_empty_graph_is_refused() -> None:
    with pytest.raises(GraphError, match="graph 'empty' has no nodes"):
        Graph("empty").verify()


# ---------------------------------------------------------------------------- authoring errors


def test_duplicate_node_name() -> None:
    g = minimal()
    with pytest.raises(GraphError, match="node 'reward' is declared twice in graph 'mini'"):
        g.reward("reward", fn="task", reads="prompts responses", writes="rewards2")
    assert g.nodes["reward"].writes == ("rewards",)  # the first declaration is kept


def test_duplicate_model_and_unknown_role() -> None:
    g = minimal()
    with pytest.raises(GraphError, match="model 'actor' is declared twice"):
        g.model("actor", "actor")
    with pytest.raises(GraphError, match="model 'judge': unknown role 'judge'"):
        g.model("judge", "judge")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda g: g.compute("c", fn="f", reads="old-logprobs", writes="x"),
            ("node 'c'", "read key 'old-logprobs'", "not a valid key name"),
        ),
        (lambda g: g.compute("c", fn="f", reads="responses", writes=["ok", "2bad"]), ("node 'c'", "write key '2bad'")),
        (lambda g: g.compute("c", fn="f", reads=["responses", 3], writes="x"), ("node 'c'", "read key 3")),
        (lambda g: g.compute("c", fn="f", reads="responses responses", writes="x"), ("node 'c'", "lists a key twice")),
        (lambda g: g.generate("g2", model="actor", n=0), ("node 'g2'", "n must be >= 1")),
        (lambda g: g.forward("f", model="actor", output="probs", writes="p"), ("node 'f'", "'probs'")),
    ],
)
def test_authoring_errors_name_node_and_key(make: Callable[[Graph], object], needle: tuple[str, ...]) -> None:
    g = minimal()
    before = dict(g.nodes)
    with pytest.raises(GraphError) as info:
        make(g)
    for part in needle:
        assert part in str(info.value)
    assert g.nodes == before  # nothing half-added


def test_invalid_graph_input_names() -> None:
    with pytest.raises(GraphError, match="input key 'my-key' is not a valid key name"):
        Graph("g", inputs=["prompts", "my-key"])
    assert Graph("g", inputs="prompts extra").inputs == ("prompts", "extra")


def test_role_defaults_for_trainable() -> None:
    g = Graph("roles")
    for role in ("actor", "critic", "reference", "reward", "cost"):
        g.model(role, role)
    assert {n: d.trainable for n, d in g.models.items()} == {
        "actor": True,
        "critic": True,
        "reference": False,
        "reward": False,
        "cost": False,
    }
    assert {n for n, d in g.models.items() if d.scalar_head} == {"critic", "reward", "cost"}


# ---------------------------------------------------------------------------- spec and fingerprint


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_spec_round_trips_through_json(name: str) -> None:
    g = build(name)
    spec = g.spec()
    back = msgspec.json.decode(msgspec.json.encode(spec), type=GraphSpec)
    assert back == spec
    assert [type(n) for n in back.nodes] == [type(n) for n in g.nodes.values()]
    assert any(isinstance(n, Train) for n in back.nodes) and any(isinstance(n, Compute) for n in back.nodes)


def test_fingerprint_is_stable_across_builds_and_processes() -> None:
    a, b = build("ppo"), build("ppo")
    assert a is not b
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16 and int(a.fingerprint(), 16) >= 0
    code = (
        "from flowrl.graphs import ppo; from flowrl.specs import RunConfig; print(ppo.build(RunConfig()).fingerprint())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == a.fingerprint()


def test_fingerprint_changes_with_content() -> None:
    base = minimal()
    fp = base.fingerprint()

    opt1, opt2 = minimal(), minimal()
    opt1.nodes.pop("reward")
    opt1.reward("reward", fn="task", reads="prompts responses", writes="rewards", per_char=0.05)
    opt2.nodes.pop("reward")
    opt2.reward("reward", fn="task", reads="prompts responses", writes="rewards", per_char=0.1)
    assert len({fp, opt1.fingerprint(), opt2.fingerprint()}) == 3

    n3 = build(
        "grpo",
        msgspec.structs.replace(
            RunConfig(), rollout=msgspec.structs.replace(RunConfig().rollout, samples_per_prompt=3)
        ),
    )
    assert n3.fingerprint() != build("grpo").fingerprint()

    frozen = minimal()
    frozen.model("ref", "reference")
    assert frozen.fingerprint() != fp
    # the name is part of the content too
    renamed = minimal()
    renamed.name = "other"
    assert renamed.fingerprint() != fp


# ------------------------------------------------------------------------ node arity (checked by verify, not at step 0)


def _variant(change: Callable[[Graph], None]) -> Graph:
    g = Graph("arity")
    g.model("actor", "actor")
    change(g)
    return g


@pytest.mark.parametrize(
    ("build_nodes", "node", "words"),
    [
        (
            lambda g: g.forward("f", model="actor", output="logprobs", reads="responses", writes="a b"),
            "f",
            "writes exactly one key",
        ),
        (
            lambda g: g.generate("rollout", model="actor", reads="prompts", writes="responses lp extra"),
            "rollout",
            "log-probs",
        ),
        (
            lambda g: g.generate("rollout", model="actor", reads="prompts responses2", writes="responses"),
            "rollout",
            "exactly one key of prompts",
        ),
        (lambda g: g.reward("r", fn="task", reads="responses", writes="rewards"), "r", "reads no prompts"),
        (
            lambda g: g.reward("r", fn="task", reads="prompts responses", writes="rewards other"),
            "r",
            "writes exactly one key",
        ),
        (
            lambda g: g.forward("f", model="actor", output="logprobs", reads="prompts", writes="lp"),
            "f",
            "reads 0 keys of generated responses",
        ),
    ],
)
def test_node_arity_is_checked_by_verify(build_nodes, node: str, words: str) -> None:
    def change(g: Graph) -> None:
        g.generate("gen0", model="actor", reads="prompts", writes="responses", n=2)
        g.generate("gen1", model="actor", reads="prompts", writes="responses2", n=2)
        g.train("train_actor", model="actor", loss="ppo", reads="responses")
        build_nodes(g)

    g = _variant(change)
    if node == "rollout":  # replaces gen0's role: drop the original
        del g.nodes["gen0"]
        g.nodes["train_actor"] = Train(name="train_actor", model="actor", loss="ppo", reads=("responses",), writes=())
    with pytest.raises(GraphError, match=words) as info:
        g.verify()
    assert f"node '{node}'" in str(info.value)


def test_a_train_node_reading_two_response_keys_is_refused() -> None:
    g = minimal()
    g.generate("second", model="actor", reads="prompts", writes="responses2", n=2)
    g.nodes["train_actor"] = Train(
        name="train_actor",
        model="actor",
        loss="ppo",
        reads=("responses", "responses2", "old_logprobs", "advantages"),
        writes=(),
    )
    with pytest.raises(GraphError, match="reads 2 keys of generated responses"):
        g.verify()
