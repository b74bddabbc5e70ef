"""Ports, graph state, filters, environments and multi-policy graphs: the IR's checks and the
planner's binding checks, with errors that name the node, port, key or state at fault."""

from __future__ import annotations

import pytest

from flowrl import api
from flowrl.errors import FlowRLError, GraphError
from flowrl.graph import Graph


def base(g: Graph | None = None) -> Graph:
    g = g or Graph("t")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=4)
    g.forward("old", model="actor", output="logprobs", writes="old_logprobs")
    g.reward("reward", fn="task")
    return g


def write(tmp_path, body: str, name: str = "g.py") -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_ports_bind_an_estimator_to_other_keys_and_the_planner_checks_them(tmp_path):
    src = write(
        tmp_path,
        """
from flowrl.graph import Graph
def build(cfg):
    g = Graph("ports")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", writes="answers", n=4)
    g.forward("old", model="actor", output="logprobs", reads="answers", writes="old_lp")
    g.reward("reward", fn="task", reads="prompts answers", writes="score")
    g.compute("adv", fn="grpo", reads="score answers", writes="adv",
              ports={"rewards": "score", "responses": "answers", "advantages": "adv"})
    g.train("train", model="actor", loss="ppo", reads="answers old_lp adv",
            ports={"old_logprobs": "old_lp", "advantages": "adv"})
    return g
""",
    )
    graph, plan = api.plan(
        src,
        overrides=["steps=2", "rollout.prompts_per_step=2", "checkpoint=false", "progress=false", f"out={tmp_path}"],
        emit=lambda s: None,
    )
    result = api.run(graph, plan)
    assert len(result.metrics) == 2 and "train/loss" in result.metrics[-1]


@pytest.mark.parametrize(
    ("ports", "reads", "message"),
    [
        ({}, "score responses", "compute function 'grpo' needs key 'rewards'"),
        ({"rewards": "nope"}, "score responses", "port 'rewards' is bound to key 'nope', which the node neither"),
        ({"rewards": "score", "bogus": "old_logprobs"}, "score responses old_logprobs", "port 'bogus'"),
    ],
)
def test_bad_port_bindings_name_port_node_and_key(tmp_path, ports, reads, message):
    src = write(
        tmp_path,
        f"""
from flowrl.graph import Graph
def build(cfg):
    g = Graph("bad")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=4)
    g.forward("old", model="actor", output="logprobs", writes="old_logprobs")
    g.reward("reward", fn="task", writes="score")
    g.compute("adv", fn="grpo", reads="{reads}", writes="advantages", ports={ports!r})
    g.train("train", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
""",
    )
    with pytest.raises(FlowRLError) as err:
        api.plan(src, emit=lambda s: None)
    assert message in str(err.value) and "node 'adv'" in str(err.value)


def test_two_ports_on_one_key_are_refused():
    g = base()
    g.compute("adv", fn="grpo", reads="rewards responses", writes="advantages", ports={"a": "rewards", "b": "rewards"})
    with pytest.raises(GraphError, match="ports 'a', 'b' are all bound to key 'rewards'"):
        g.verify()


def test_state_is_declared_once_updated_by_one_compute_node_and_read_before_the_update():
    g = base()
    g.state("lam", 1.0, low=0.0)
    g.compute("use", fn="grpo", reads="rewards responses lam", writes="advantages")
    g.compute(
        "step",
        fn="lagrange_update",
        reads="rewards lam",
        updates="lam",
        ports={"costs": "rewards", "multiplier": "lam"},
    )
    g.train("train", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    g.verify()
    order = g.order()
    assert order.index("use") < order.index("step")  # readers see the value before this iteration's update
    assert g.dag().edges["use", "step"]["state"] == "lam"
    with pytest.raises(GraphError, match="state 'lam' is declared twice"):
        g.state("lam", 0.0)
    with pytest.raises(GraphError, match="low 2.0 is above high 1.0"):
        g.state("other", 1.0, low=2.0, high=1.0)


def test_state_errors_name_the_state_and_node():
    g = base()
    g.compute("step", fn="lagrange_update", reads="rewards", updates="lamda")
    g.train("train", model="actor", loss="ppo", reads="responses old_logprobs rewards")
    with pytest.raises(GraphError, match="node 'step' updates state 'lamda', which is not declared"):
        g.verify()
    g2 = base()
    g2.state("lam", 1.0)
    g2.compute("a", fn="x", reads="rewards lam", writes="k1", updates="lam")
    g2.compute("b", fn="x", reads="rewards lam", writes="k2", updates="lam")
    g2.train("train", model="actor", loss="ppo", reads="responses old_logprobs k1 k2")
    with pytest.raises(GraphError, match="state 'lam' is updated by two nodes"):
        g2.verify()
    g3 = base()
    g3.state("rewards_state", 1.0)
    g3.state("old_logprobs", 1.0)
    g3.train("train", model="actor", loss="ppo", reads="responses old_logprobs rewards")
    with pytest.raises(GraphError, match="state 'old_logprobs' has the name of a key"):
        g3.verify()


def test_a_filter_orders_every_later_reader_of_the_rows_after_it_and_is_absorbed_into_generation():
    g = base()
    g.filter("keep", fn="nonconstant", reads="rewards responses", max_rounds=3)
    g.compute("adv", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    g.verify()
    assert g.filters() == {"rollout": "keep"}
    assert g.filter_segment("keep") == ("rollout", ["reward"])
    order = g.order()
    assert order.index("keep") < order.index("old") and order.index("keep") < order.index("adv")


def test_a_filter_may_not_depend_on_a_model_node():
    g = base()
    g.filter("keep", fn="nonconstant", reads="old_logprobs responses")
    g.train("train", model="actor", loss="ppo", reads="responses old_logprobs rewards")
    with pytest.raises(GraphError, match="filter 'keep' depends on forward node 'old'"):
        g.verify()


def test_filters_refuse_chunked_rollouts_and_environments_take_them():
    with pytest.raises(FlowRLError, match="decodes in chunks"):
        api.plan("graphs/dapo.py", overrides=["rollout.mode=async"], emit=lambda s: None)
    for mode in ("async", "partial", "streaming", "partial+async"):
        _, plan = api.plan("graphs/tool_use.py", overrides=[f"rollout.mode={mode}"], emit=lambda s: None)
        assert plan.layout.rollout.chunked


def test_environment_generation_needs_a_registered_environment_and_turns_need_one():
    g = Graph("t")
    g.model("actor", "actor")
    with pytest.raises(GraphError, match="turns=3 needs an environment"):
        g.generate("rollout", model="actor", turns=3)


@pytest.mark.parametrize(
    "graph", [*(pytest.param(g, marks=pytest.mark.slow) for g in ("dapo", "safe_rlhf", "two_agent")), "tool_use"]
)
@pytest.mark.slow
def test_shipped_graphs_plan_for_a_cluster_with_explain(graph):
    from flowrl.cli import main

    assert main(["plan", f"graphs/{graph}.py", "--cluster", "16xA100-80G", "--model", "llama-7b", "--explain"]) == 0


def test_two_policies_get_their_own_generation_layouts_and_syncs():
    graph, plan = api.plan("graphs/two_agent.py", emit=lambda s: None)
    assert [g.model for g in plan.layout.generations] == ["solver"]
    from flowrl.runtime.schedule import lower

    schedule = lower(graph, plan)
    gens = {t.name: t.model for t in schedule.tasks if t.kind == "generate"}
    assert gens == {"propose": "proposer", "solve": "solver"}
    assert {m.model for m in schedule.models if m.generation_group is not None} == {"proposer", "solver"}


@pytest.mark.slow
def test_the_planner_costs_dynamic_sampling_rounds_from_the_acceptance_rate(tmp_path):
    from flowrl.cli import main
    from flowrl.contract.plan import load_plan

    rollout = {}
    for rate in (1.0, 0.5, 0.1):
        workload = tmp_path / f"w{rate}.yaml"
        workload.write_text(
            f"prompts_per_step: 128\nsamples_per_prompt: 8\nprompt_length: 512\nresponse_length: 1024\n"
            f"acceptance_rate: {rate}\n"
        )
        out = tmp_path / f"plan{rate}.yaml"
        args = ["plan", "graphs/dapo.py", "--cluster", "8xH100-80G", "--model", "llama-7b", "--workload", str(workload)]
        assert main([*args, "--placement", "colocate", "--out", str(out)]) == 0
        rollout[rate] = load_plan(out).layout.predicted.breakdown["rollout"]
    assert rollout[0.5] == pytest.approx(2 * rollout[1.0], rel=0.15)  # two rounds
    assert rollout[0.1] == pytest.approx(3 * rollout[1.0], rel=0.15)  # capped at the filter's max_rounds (3)
