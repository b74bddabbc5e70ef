"""`api.plan_ranked`: one plan per tuner candidate, best first, each the plan `api.plan` would return had
that candidate won -- its own layout, its own objective record, the later passes run on it -- and the
first one `api.plan`'s own plan; a run on one device has one plan to rank."""

from __future__ import annotations

import pytest

from flowrl import api
from flowrl.contract.plan import ClusterTarget
from flowrl.errors import PlanError
from flowrl.planner.autotune import distinct
from flowrl.planner.hardware import parse_cluster
from flowrl.planner.modelspec import MODEL_PRESETS
from flowrl.planner.passes import PIPELINE, PassResults, verify_plan

TARGET = ClusterTarget(cluster=parse_cluster("4xH100-80G"), model=MODEL_PRESETS["qwen2.5-0.5b"])


@pytest.mark.parametrize("objective", ["throughput", "time-to-target"])
@pytest.mark.slow
def test_each_ranked_plan_is_its_candidates_plan_and_the_first_is_the_planners(objective):
    options = {"objective": objective, "target_steps": 50}
    results = PassResults()
    graph, plans = api.plan_ranked("grpo", top=3, target=TARGET, options=options, results=results, emit=lambda s: None)
    tune = results.place.tune
    wanted = distinct(tune.ranked, 3)
    assert len(plans) == len(wanted) == 3
    assert len({p.layout.summary() for p in plans}) == 3  # distinct plans, in the tuner's order
    for plan, candidate in zip(plans, wanted, strict=True):
        assert plan.layout == candidate.plan
        assert plan.passes == PIPELINE and plan.id == plan.content_id()
        assert {n.node for n in plan.nodes} == set(graph.nodes)  # micro_batch ran on this layout
        verify_plan(graph, plan)
        record = plan.objective  # the candidate's own prediction, not the winner's
        assert record.kind == objective and record.target_steps == 50
        assert record.iteration_s == pytest.approx(candidate.result.iteration_s, rel=1e-5)
        assert record.time_to_target_s == pytest.approx(
            tune.objective.time_to_target(candidate.plan, candidate.result.iteration_s), rel=1e-3
        )
    scores = [tune.objective.score(c.plan, c.result.iteration_s) for c in wanted]
    assert scores == sorted(scores)
    _, alone = api.plan("grpo", target=TARGET, options=options, emit=lambda s: None)
    assert alone.id == plans[0].id


def test_ranked_by_shape_each_plan_places_or_parallelises_differently_and_is_its_shapes_best():
    results = PassResults()
    _, plans = api.plan_ranked("grpo", top=3, target=TARGET, results=results, shapes=True, emit=lambda s: None)
    ranked = results.place.tune.ranked
    shapes = [p.layout.shape() for p in plans]
    assert len(set(shapes)) == 3 and all("mb" not in s and " off" not in s for s in shapes)
    for plan in plans:  # the first candidate of its shape in the tuner's order
        assert plan.layout == next(c.plan for c in ranked if c.plan.shape() == plan.layout.shape())
    assert plans[0].layout == ranked[0].plan
    knobs = distinct(ranked, len(ranked))  # by summary, candidates may share a shape (micro-batch, offload)
    assert len(knobs) >= len(distinct(ranked, len(ranked), shapes=True))


def test_a_run_on_this_machines_one_device_has_one_plan():
    _, plans = api.plan_ranked("grpo", top=3, emit=lambda s: None)  # the local executor: one device, colocated
    _, alone = api.plan("grpo", emit=lambda s: None)
    assert [p.id for p in plans] == [alone.id] and plans[0].layout.placement == "colocate"


def test_asking_for_no_candidates_is_refused():
    with pytest.raises(PlanError, match="top is 0"):
        api.plan_ranked("grpo", top=0, target=TARGET, emit=lambda s: None)


def test_plans_differing_only_in_micro_batch_or_offload_share_a_shape_and_the_first_of_a_shape_is_kept():
    import dataclasses

    import msgspec

    results = PassResults()
    api.plan_ranked("grpo", top=1, target=TARGET, results=results, emit=lambda s: None)
    best, other = results.place.tune.ranked[:2]
    assert best.plan.shape() != other.plan.shape()
    models = tuple(
        msgspec.structs.replace(m, micro_batch=m.micro_batch + 1, offload_optimizer=not m.offload_optimizer)
        for m in best.plan.models
    )
    knob = dataclasses.replace(best, plan=msgspec.structs.replace(best.plan, models=models))
    assert knob.plan.shape() == best.plan.shape() and knob.plan.summary() != best.plan.summary()
    ranked = [best, knob, other]
    assert distinct(ranked, 3, shapes=True) == [best, other]  # the best of each shape, in order
    assert distinct(ranked, 3) == ranked
    assert distinct(ranked, 1, shapes=True) == [best]
