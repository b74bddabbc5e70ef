"""The planner costs forward and train passes the way the runtime cuts them: with a token budget
(``train.max_tokens_per_micro_batch``) a micro-batch is filled with rows up to the budget, and packed
(``train.pack``) it computes its real tokens; its memory is then bounded by the budget, not by its rows at
the longest sequence."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from flowrl import api
from flowrl.contract.layout import ClusterPlan
from flowrl.contract.workload import LogNormal, sample_lengths
from flowrl.planner import memory as mem
from flowrl.planner.autotune import Tuner
from flowrl.planner.hardware import parse_cluster
from flowrl.planner.modelspec import MODEL_PRESETS
from flowrl.planner.simulate import MicroBatching, padded_length, simulate
from flowrl.planner.space import DeviceGroup, GenerationLayout, ModelLayout, Parallel, RolloutPolicy, WeightSync
from flowrl.planner.workload import WorkloadSpec

MODEL = MODEL_PRESETS["qwen2.5-1.5b"]
CLUSTER = parse_cluster("16xA100-80G")
# a long tail: most responses short, a few near the 16K budget
LONG_TAIL = WorkloadSpec(
    prompts_per_step=64,
    samples_per_prompt=8,
    prompt_length=256,
    response_length=LogNormal(median=600, sigma=1.0, max=16384),
)
BUDGET = MicroBatching(max_tokens=32768, pack=True)


def lengths(n: int = 512) -> np.ndarray:
    return sample_lengths(LONG_TAIL.response_length, n, np.random.default_rng(0))


def test_without_a_budget_a_micro_batch_is_the_layouts_rows_padded_to_their_longest():
    got = MicroBatching().cut(lengths(), 256, 4, 8)
    assert got == (4, int(round(padded_length(lengths(), 256, 4 * 8))))


def test_packed_micro_batches_compute_the_real_tokens_only():
    rows, seq = MicroBatching(pack=True).cut(lengths(), 256, 4, 8)
    assert rows == 4
    assert seq == int(round(256 + lengths().mean()))
    assert seq < MicroBatching().cut(lengths(), 256, 4, 8)[1]  # padding to the longest costs more


def test_a_token_budget_fills_micro_batches_up_to_the_budget_within_the_row_cap():
    rows, seq = BUDGET.cut(lengths(), 256, 1024, 8)
    assert rows == 32768 // seq  # as many mean-length rows as the budget holds
    assert BUDGET.cut(lengths(), 256, 4, 8)[0] == 4  # the layout's rows stay a cap
    assert MicroBatching(max_tokens=100).cut(lengths(), 256, 16, 8)[0] == 1  # a longer row is computed alone
    # a micro-batch held at once: as many of the longest sequences as the budget holds, at least one
    assert BUDGET.memory_rows(64, 16640) == 1
    assert MicroBatching(max_tokens=40000).memory_rows(64, 16640) == 2
    assert MicroBatching().memory_rows(64, 16640) == 64


def test_the_tuner_bounds_a_budgeted_layouts_memory_by_the_budget_and_costs_its_fuller_micro_batches():
    graph = api.load("grpo")[0]
    rows = Tuner(graph, MODEL, CLUSTER, LONG_TAIL)
    budgeted = Tuner(graph, MODEL, CLUSTER, LONG_TAIL, batching=BUDGET)
    wide = ModelLayout(model="actor", group="g", parallel=Parallel(dp=16, tp=1, pp=1), micro_batch=32)
    narrow = msgspec.structs.replace(wide, micro_batch=1)
    # rows only: 32 rows of the longest sequence are held at once; under the budget, what 32K tokens hold
    assert budgeted.score(wide)[3] < rows.score(wide)[3] / 8
    held = msgspec.structs.replace(wide, micro_batch=1)
    longest = LONG_TAIL.prompt_length + LONG_TAIL.max_response()
    assert budgeted.score(wide)[3] == mem.model_pass_bytes(MODEL, budgeted.numerics, held, longest, True, 1)
    # time: the budget's micro-batches of real tokens are cheaper than one padded row at a time
    assert budgeted.score(wide)[1] < rows.score(narrow)[1]


def _plan(micro_batch: int) -> ClusterPlan:
    models = tuple(
        ModelLayout(model=m, group="train", parallel=Parallel(dp=8, tp=1, pp=1), micro_batch=micro_batch)
        for m in ("actor", "ref")
    )
    return ClusterPlan(
        placement="disaggregated",
        groups=(DeviceGroup(name="gen", devices=8, first=0), DeviceGroup(name="train", devices=8, first=8)),
        models=models,
        generation=GenerationLayout(group="gen", tp=1, replicas=8),
        rollout=RolloutPolicy(),
        weight_sync=WeightSync(strategy="bucketed"),
    )


@pytest.mark.parametrize("node", ["train_actor", "ref_logprobs"])
def test_the_simulator_costs_passes_at_the_budgets_micro_batches(node):
    graph = api.load("grpo")[0]
    tuner = Tuner(graph, MODEL, CLUSTER, LONG_TAIL)

    def seconds(plan: ClusterPlan, batching: MicroBatching) -> float:
        result = simulate(graph, plan, tuner.cost, LONG_TAIL, tuner.roles, static_gen_bytes=0, batching=batching)
        return result.breakdown[node]

    one_row = seconds(_plan(1), MicroBatching())
    assert seconds(_plan(64), BUDGET) < one_row
    assert seconds(_plan(1), BUDGET) == pytest.approx(seconds(_plan(1), MicroBatching(pack=True)))  # capped at 1 row
    assert seconds(_plan(1), MicroBatching(pack=True)) < one_row  # no padding
