"""Several rewards combined with weights: the built-in compute function `weighted_sum` writes
sum_k w_k * r_k over the keys its node reads; its weights name exactly those keys. Each part's
reward node keeps its own metrics."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from flowrl import api
from flowrl.algorithms.ops import COMPUTE_FUNCTIONS, grpo_op, task_reward, weighted_sum_op
from flowrl.contract.data import Prompt, Sequences
from flowrl.errors import GraphError
from flowrl.graph import Graph
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import load_plugins
from flowrl.specs import AlgoConfig
from flowrl.tasks import verifiers

TINY = ["steps=2", "seed=0", "progress=false", "checkpoint=false"]
TINY += ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"]


def seqs(rows: int) -> Sequences:
    return Sequences(
        prompt_ids=torch.ones(rows, 2, dtype=torch.long),
        prompt_mask=torch.ones(rows, 2, dtype=torch.long),
        response_ids=torch.ones(rows, 3, dtype=torch.long),
        response_mask=torch.ones(rows, 3),
        prompt_index=torch.arange(rows) // 2,
        texts=("",) * rows,
    )


# ------------------------------------------------------------------ the function


def test_weighted_sum_is_the_weighted_sum_of_the_keys_read():
    inputs = {"r_correct": torch.tensor([1.0, 0.0, 1.0, 0.5]), "r_len": torch.tensor([-2.0, 3.0, 0.0, 10.0])}
    out, metrics = weighted_sum_op(inputs, AlgoConfig(), weights={"r_correct": 1.0, "r_len": 0.1})
    want = torch.tensor([1.0 - 0.2, 0.3, 1.0, 0.5 + 1.0])
    assert torch.allclose(out["rewards"], want)
    assert metrics["reward"] == pytest.approx(float(want.mean()), abs=1e-6)


def test_weighted_sum_skips_the_responses_it_reads_for_the_row_check():
    inputs = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0]), "responses": seqs(2)}
    out, _ = weighted_sum_op(inputs, AlgoConfig(), weights={"a": 2.0, "b": -1.0})
    assert out["rewards"].tolist() == [-1.0, 0.0]


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"a": 1.0}, r"no weight for key 'b', which it reads"),
        ({"a": 1.0, "b": 1.0, "c": 1.0}, r"a weight for key 'c', which it does not read"),
        ({"a": 1.0, "c": 1.0}, r"no weight for key 'b'.*a weight for key 'c'"),
        (None, r"needs the option weights="),
        ({}, r"needs the option weights="),
    ],
)
def test_weights_must_name_exactly_the_keys_read(weights, match):
    inputs = {"a": torch.tensor([1.0]), "b": torch.tensor([2.0])}
    with pytest.raises(GraphError, match=match):
        weighted_sum_op(inputs, AlgoConfig(), weights=weights)


def test_weighted_keys_must_have_one_shape():
    inputs = {"a": torch.ones(2), "b": torch.ones(2, 3)}
    with pytest.raises(GraphError, match=r"key '(a|b)' has shape"):
        weighted_sum_op(inputs, AlgoConfig(), weights={"a": 1.0, "b": 1.0})


def test_weighted_sum_is_registered_with_its_output_port():
    fn, meta = COMPUTE_FUNCTIONS["weighted_sum"]
    assert fn is weighted_sum_op and meta["gives"] == ("rewards",) and meta["needs"] == ()


# ------------------------------------------------------------------ task rewards report unparsed answers


class VerifiedTask:
    """A task scoring with the math verifier, as a dataset task does."""

    def score(self, prompt: Prompt, response: str) -> float:
        return verifiers.verify("math", response, verifiers.ground_truth(prompt.answer))


def test_task_reward_reports_the_ground_truths_its_verifier_could_not_read():
    prompts = [Prompt(text="q", answer="#### 4"), Prompt(text="q", answer="blue"), Prompt(text="q", answer="7")]
    scores, metrics = task_reward(prompts, [r"\boxed{4}", "blue", "the answer is 8"], VerifiedTask())
    assert scores.tolist() == [1.0, 0.0, 0.0]
    assert metrics == {"exact": pytest.approx(1 / 3, abs=1e-4), "unparsed_answers": 1}


def test_task_reward_of_a_task_without_verifier_reports_no_unparsed_answers():
    class Toy:
        def score(self, prompt, response):
            return float(prompt.answer == response)

    _, metrics = task_reward([Prompt(text="q", answer="a")], ["a"], Toy())
    assert metrics == {"exact": 1.0}


# ------------------------------------------------------------------ in a graph, end to end

SEEN: list[dict[str, torch.Tensor]] = []


def _length(prompts: list[Any], responses: list[str], task: Any) -> list[float]:
    return [-float(len(r)) for r in responses]


def _spy_grpo(inputs: dict[str, Any], algo: AlgoConfig, *, key: str = "rewards") -> dict[str, torch.Tensor]:
    """GRPO advantages of the combined rewards (key ``key``), keeping what it read for the test."""
    SEEN.append({("rewards" if k == key else k): v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
    return grpo_op({"rewards": inputs[key], "responses": inputs["responses"]}, algo)


def _registry(weights: dict[str, float], writes: str = "rewards", ports: dict[str, str] | None = None) -> Any:
    def build(cfg: Any) -> Graph:
        g = Graph("weighted")
        g.model("actor", "actor")
        g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
        g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
        g.reward("correct", fn="task", writes="r_correct")
        g.reward("short", fn="my_len", writes="r_len")
        g.compute("total", fn="weighted_sum", reads="r_correct r_len", writes=writes, ports=ports, weights=weights)
        g.compute(
            "advantages",
            fn="spy_grpo",
            reads=f"{writes} r_correct r_len responses",
            writes="advantages",
            key=writes,
        )
        g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
        return g

    module = types.ModuleType("weighted_fns")
    module.register_algorithms = hookimpl(lambda register: register("weighted", build))
    module.register_reward_functions = hookimpl(lambda register: register("my_len", _length))
    module.register_compute_functions = hookimpl(
        lambda register: register("spy_grpo", _spy_grpo, gives=("advantages",))
    )
    return load_plugins(entry_points=False, extra=[("weighted_fns", module)])[1]


@pytest.mark.parametrize(("writes", "ports"), [("rewards", None), ("combined", {"rewards": "combined"})])
@pytest.mark.slow
def test_a_graph_combines_two_rewards_with_weights(tmp_path, writes, ports):
    SEEN.clear()
    reg = _registry({"r_correct": 1.0, "r_len": 0.1}, writes, ports)
    g, plan = api.plan("weighted", registry=reg, overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
    result = api.run(g, plan, registry=reg)
    assert len(SEEN) == 2  # one per step
    for seen in SEEN:
        assert seen["r_len"].abs().sum() > 0  # the length part is not trivially zero
        assert torch.allclose(seen["rewards"], 1.0 * seen["r_correct"] + 0.1 * seen["r_len"])
    for record, seen in zip(result.metrics, SEEN):
        # each part's reward node keeps its own metrics; the sum reports its mean
        assert record["correct/reward"] == pytest.approx(float(seen["r_correct"].mean()), abs=1e-5)
        assert 0.0 <= record["correct/exact"] <= 1.0
        assert record["short/reward"] == pytest.approx(float(seen["r_len"].mean()), abs=1e-5)
        assert record["total/reward"] == pytest.approx(float(seen["rewards"].mean()), abs=1e-5)
        if writes == "rewards":  # the headline reward is the weighted sum's, not a part's
            assert record["reward"] == record["total/reward"]


def test_weights_naming_a_key_the_node_does_not_read_stop_the_run_naming_node_and_key(tmp_path):
    reg = _registry({"r_correct": 1.0, "r_length": 0.1})
    g, plan = api.plan("weighted", registry=reg, overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
    with pytest.raises(GraphError, match=r"^node 'total': .*no weight for key 'r_len'.*a weight for key 'r_length'"):
        api.run(g, plan, registry=reg)


def test_weights_of_the_wrong_type_are_refused_at_plan_time(tmp_path):
    reg = _registry({"r_correct": 1.0, "r_len": "a lot"})
    with pytest.raises(GraphError, match=r"node 'total': option 'weights'"):
        api.plan("weighted", registry=reg, overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
