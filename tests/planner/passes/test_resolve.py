"""The ``resolve`` pass: config defaults, the response budget and workload, devices and engine
names, and the functions, losses, keys and node options a graph names."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest
from pass_helpers import QUIET, SMALL, local_plan, plan

from flowrl import api
from flowrl.contract.plan import ExecutionPlan
from flowrl.errors import ConfigError, FlowRLError, GraphError, PlanError, TaskError
from flowrl.graph import Graph
from flowrl.planner.manager import run_passes
from flowrl.planner.passes import PIPELINE
from flowrl.planner.workload import Fixed, WorkloadSpec
from flowrl.plugins.manager import Registry
from flowrl.specs import RunConfig, build_config
from flowrl.tasks.builtin import make_task


def test_ppo_defaults_apply(registry: Registry) -> None:
    _, p = api.plan("ppo", registry=registry, emit=QUIET)
    from flowrl.graphs.ppo import DEFAULTS

    rollout = DEFAULTS["rollout"]
    assert {n.rows for n in p.nodes} == {rollout["prompts_per_step"] * rollout["samples_per_prompt"]}
    assert p.workload.prompts_per_step == rollout["prompts_per_step"]
    assert p.workload.samples_per_prompt == rollout["samples_per_prompt"]


def test_resolve_fills_max_new_tokens_from_the_task(registry: Registry) -> None:
    _, p, _ = plan("grpo", registry)
    assert RunConfig().rollout.max_new_tokens is None
    assert p.config.rollout.max_new_tokens == make_task(RunConfig().task).max_new_tokens()
    _, p, _ = plan("grpo", registry, "rollout.max_new_tokens=2")
    assert p.config.rollout.max_new_tokens == 2


def test_resolve_derives_the_workload_from_the_config(registry: Registry) -> None:
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "rollout.max_new_tokens=5", "train.epochs=3"])
    p0 = local_plan(graph, cfg, registry)
    assert p0.target.workload is None
    with pytest.raises(ConfigError, match="no workload yet"):
        _ = p0.workload
    p = run_passes(graph, p0, registry, passes=("resolve",), emit=QUIET)
    # the copy task: prompts '<s>' + at most 4 letters + '>'; answers of 1-4 letters + EOS, capped at the budget
    assert p.workload.response_length.lengths == [2, 3, 4, 5]
    assert p.workload == WorkloadSpec(
        prompts_per_step=4,
        samples_per_prompt=3,
        prompt_length=6,
        response_length=p.workload.response_length,
        ppo_epochs=3,
        mini_batches=2,
    )
    graph, cfg = api.load(
        "grpo", registry=registry, overrides=[*SMALL, "rollout.max_new_tokens=5", "rollout.ignore_eos=true"]
    )
    p = run_passes(graph, local_plan(graph, cfg, registry), registry, passes=("resolve",), emit=QUIET)
    assert p.workload.response_length == Fixed(value=5)  # every response runs to the budget
    # more mini-batches than sequences is refused, naming the train node
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "train.mini_batches=50"])
    message = "^pass 'resolve': node 'train_actor': 50 mini-batches but only 12 rows per step"
    with pytest.raises(PlanError, match=message):
        run_passes(graph, local_plan(graph, cfg, registry), registry, passes=("resolve",), emit=QUIET)
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "train.mini_batches=12"])
    p = run_passes(graph, local_plan(graph, cfg, registry), registry, passes=("resolve",), emit=QUIET)
    assert p.workload.mini_batches == 12
    # a workload the target gives is kept
    given = WorkloadSpec(prompts_per_step=2, samples_per_prompt=2, prompt_length=8, response_length=Fixed(value=4))
    p0 = local_plan(graph, cfg, registry)
    p0 = msgspec.structs.replace(p0, target=msgspec.structs.replace(p0.target, workload=given))
    assert run_passes(graph, p0, registry, passes=("resolve",), emit=QUIET).workload == given


def test_invalid_device_is_refused_at_plan_time(registry: Registry) -> None:
    message = "config field 'device' is 'tpu'; the local engines run on 'cpu', 'cuda', 'cuda:N' or 'auto'"
    with pytest.raises(PlanError, match=re.escape(message)):
        plan("grpo", registry, "device=tpu")


def test_cuda_without_cuda_is_refused_at_plan_time_and_by_the_executor(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    graph, p, _ = plan("grpo", registry)  # on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PlanError, match="config field 'device' is 'cuda' but torch sees no CUDA device here"):
        plan("grpo", registry, "device=cuda")
    on_cuda = msgspec.structs.replace(p, config=msgspec.structs.replace(p.config, device="cuda")).sealed()
    with pytest.raises(PlanError, match="config field 'device' is 'cuda' but torch sees no CUDA device here"):
        api.check(graph, on_cuda, registry)
    api.check(graph, p, registry)  # the CPU plan itself is fine


@pytest.mark.parametrize(
    ("override", "field", "what"),
    [
        ("backend=nope", "executor", "executor"),
        ("generation.engine=nope", "generation.engine", "generation engine"),
        ("train.engine=nope", "train.engine", "training engine"),
    ],
)
def test_unknown_executor_or_engine_names_the_config_field(
    registry: Registry, override: str, field: str, what: str
) -> None:
    with pytest.raises(ConfigError, match=rf"config field '{re.escape(field)}': unknown {what} 'nope'\. Known: local"):
        plan("grpo", registry, override)


def test_resolve_checks_engine_names_for_any_target(registry: Registry) -> None:
    graph, cfg = api.load("grpo", registry=registry, overrides=[*SMALL, "train.engine=locl"])
    message = "^pass 'resolve': config field 'train.engine': unknown training engine 'locl'"
    with pytest.raises(ConfigError, match=message):
        run_passes(graph, local_plan(graph, cfg, registry), registry, emit=QUIET)


def _graph(
    reward_fn: str = "task",
    compute_fn: str = "grpo",
    compute_reads: str = "rewards responses",
    compute_writes: str = "advantages",
    loss: str = "ppo",
    train: dict[str, Any] | None = None,
    compute: dict[str, Any] | None = None,
    forward: dict[str, Any] | None = None,
) -> Graph:
    g = Graph("custom")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=2)
    g.forward(
        "old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs", **(forward or {})
    )
    g.reward("reward", fn=reward_fn)
    g.compute("adv", fn=compute_fn, reads=compute_reads, writes=compute_writes, **(compute or {}))
    g.train("train_actor", model="actor", loss=loss, reads="responses old_logprobs advantages", **(train or {}))
    return g.verify()


def _resolve(graph: Graph, registry: Registry, **config: Any) -> ExecutionPlan:
    cfg = build_config({"rollout": {"prompts_per_step": 2, "samples_per_prompt": 2}}, config)
    return run_passes(graph, local_plan(graph, cfg, registry, "custom.py"), registry, emit=QUIET)


def test_custom_graph_plans(registry: Registry) -> None:
    p = _resolve(_graph(), registry)
    assert p.graph.source == "custom.py" and p.passes == PIPELINE


def test_unknown_reward_function(registry: Registry) -> None:
    with pytest.raises(FlowRLError) as info:
        _resolve(_graph(reward_fn="taks"), registry)
    message = str(info.value)
    assert message.startswith("pass 'resolve': ")
    assert "unknown reward function 'taks'" in message and "Did you mean 'task'?" in message


def test_unknown_loss(registry: Registry) -> None:
    with pytest.raises(FlowRLError) as info:
        _resolve(_graph(loss="ppo2"), registry)
    message = str(info.value)
    assert "pass 'resolve'" in message and "'ppo2'" in message and "Did you mean 'ppo'?" in message


def test_unknown_compute_function(registry: Registry) -> None:
    with pytest.raises(FlowRLError, match="unknown compute function 'grpoo'"):
        _resolve(_graph(compute_fn="grpoo"), registry)


def test_compute_function_needs_a_key_the_node_does_not_read(registry: Registry) -> None:
    # gae needs values (and rewards, responses); this node forgets values
    graph = _graph(compute_fn="gae", compute_reads="rewards responses", compute_writes="advantages")
    with pytest.raises(PlanError) as info:
        _resolve(graph, registry)
    message = str(info.value)
    assert "pass 'resolve'" in message and "node 'adv'" in message
    assert "compute function 'gae'" in message and "needs key 'values'" in message


def test_compute_node_writes_a_key_the_function_does_not_give(registry: Registry) -> None:
    graph = _graph(compute_writes="advantages returns")
    message = "node 'adv' writes key 'returns', but compute function 'grpo' only produces advantages"
    with pytest.raises(PlanError, match=message):
        _resolve(graph, registry)


def test_loss_needs_a_key_the_train_node_does_not_read(registry: Registry) -> None:
    g = Graph("custom")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=2)
    g.reward("reward", fn="task")
    g.compute("adv", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses advantages")
    with pytest.raises(PlanError, match="node 'train_actor': loss 'ppo' needs key 'old_logprobs'"):
        _resolve(g.verify(), registry)


def test_value_loss_on_an_actor_is_refused(registry: Registry) -> None:
    g = Graph("custom")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", n=2)
    g.forward("values", model="actor", output="logprobs", reads="responses", writes="values")
    g.reward("reward", fn="task")
    g.compute("gae", fn="gae", reads="rewards values responses", writes="advantages returns")
    g.train("train_actor", model="actor", loss="value", reads="responses values returns")
    message = "node 'train_actor': loss 'value' trains on values, but model 'actor' \\(role actor\\) produces logprobs"
    with pytest.raises(PlanError, match=message):
        _resolve(g.verify(), registry)


def test_unknown_task(registry: Registry) -> None:
    with pytest.raises(TaskError, match="pass 'resolve'.*unknown task 'ad'"):
        _resolve(_graph(), registry, task="ad")


def test_valid_node_options_plan(registry: Registry) -> None:
    graph = _graph(
        train={"epochs": 2, "mini_batches": 1, "clip_low": 0.1},
        compute={"eps": 1e-4, "scale": False},
        forward={"kl_coef": 0.0},
    )
    assert _resolve(graph, registry).passes == PIPELINE


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"train": {"warmup": 3}}, "node 'train_actor': unknown option(s) warmup; allowed: "),
        ({"compute": {"epsilon": 1e-4}}, "node 'adv': unknown option(s) epsilon; allowed: "),
        ({"forward": {"epochs": 2}}, "node 'old_logprobs': unknown option(s) epochs; allowed: "),
        ({"train": {"clip_low": "wide"}}, "node 'train_actor': bad option: "),
        ({"train": {"kl_estimator": "k9"}}, "node 'train_actor': bad option: "),
        ({"train": {"epochs": 0}}, "node 'train_actor': option 'epochs' must be an integer >= 1, got 0."),
        (
            {"train": {"mini_batches": 1.5}},
            "node 'train_actor': option 'mini_batches' must be an integer >= 1, got 1.5.",
        ),
        ({"train": {"epochs": True}}, "node 'train_actor': option 'epochs' must be an integer >= 1, got True."),
    ],
)
def test_bad_node_options_are_refused_by_resolve(registry: Registry, options: dict[str, Any], message: str) -> None:
    with pytest.raises(GraphError) as info:
        _resolve(_graph(**options), registry)
    assert str(info.value).startswith("pass 'resolve': ")
    assert message in str(info.value)


def test_a_train_node_with_more_mini_batches_than_rows_is_refused(registry: Registry) -> None:
    # 2 prompts x 2 samples: 4 rows reach the train node
    assert _resolve(_graph(train={"mini_batches": 4}), registry).node("train_actor").rows == 4
    with pytest.raises(PlanError, match="^pass 'resolve': node 'train_actor': 5 mini-batches but only 4 rows per step"):
        _resolve(_graph(train={"mini_batches": 5}), registry)


def test_unknown_option_lists_what_is_allowed(registry: Registry) -> None:
    with pytest.raises(GraphError) as info:
        _resolve(_graph(compute={"epsilon": 1e-4}), registry)
    allowed = str(info.value).split("allowed: ", 1)[1]
    assert "eps" in allowed and "scale" in allowed and "clip_low" in allowed


def test_api_plan_refuses_an_unknown_node_option_in_a_graph_file(registry: Registry, tmp_path: Path) -> None:
    source = tmp_path / "opts.py"
    source.write_text(
        textwrap.dedent("""
        from flowrl.graph import Graph


        def build(cfg):
            g = Graph("opts")
            g.model("actor", "actor")
            g.model("ref", "reference", init_from="actor")
            g.generate("rollout", model="actor", n=cfg.rollout.samples_per_prompt)
            g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
            g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")
            g.reward("reward", fn="task")
            g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
            g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs ref_logprobs advantages",
                    epochs=2, warmup_steps=10)
            return g
    """)
    )
    out: list[str] = []
    with pytest.raises(GraphError) as info:
        api.plan(str(source), registry=registry, overrides=SMALL, emit=out.append, print_after=["all"])
    message = str(info.value)
    assert message.startswith("pass 'resolve': node 'train_actor': unknown option(s) warmup_steps")
    assert "epochs" in message.split("allowed: ", 1)[1]
    assert out == []  # refused in the first pass, before anything is printed
