"""What a finished run reports about predictions comes through the `Predictor` its caller passes
(the planner's simulator, handed in by the API), never from the runtime calling the planner."""

from __future__ import annotations

from flowrl import api
from flowrl.contract import ExecutionPlan, Forecast, Graph, Predictor
from flowrl.planner.predict import Simulator
from flowrl.plugins.manager import registry
from flowrl.runtime.executor import PlanExecutor, run_dir

TINY = [
    "seed=0",
    "progress=false",
    "checkpoint=false",
    "task=repeat",
    "steps=2",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=4",
]


class Recording(Simulator):
    """The planner's simulator, keeping each forecast it made (here and in ``made``)."""

    made: list[Forecast] = []

    def __init__(self, reg=None) -> None:
        super().__init__(reg or registry())
        self.forecasts: list[Forecast] = []

    def predict(self, graph: Graph, plan: ExecutionPlan) -> Forecast:
        forecast = super().predict(graph, plan)
        self.forecasts.append(forecast)
        Recording.made.append(forecast)
        return forecast


def test_the_planners_simulator_is_a_predictor_of_a_placed_plan():
    graph, plan = api.plan("grpo", overrides=TINY, emit=lambda s: None)
    simulator = Simulator(registry())
    assert isinstance(simulator, Predictor)
    forecast = simulator.predict(graph, plan)
    assert forecast.iteration_s > 0 and forecast.spans
    groups = {g for _, on, *_ in forecast.spans for g in on}
    assert groups <= {g.name for g in plan.layout.groups} | {"controller"}


def test_a_run_draws_its_timeline_against_the_predictor_it_is_given(tmp_path):
    graph, plan = api.plan("grpo", overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
    executor = PlanExecutor(registry())
    executor.check(graph, plan)
    predictor = Recording()
    out = run_dir(str(tmp_path), "grpo")
    executor.run(graph, plan, out, predictor=predictor)
    (forecast,) = predictor.forecasts
    assert forecast.iteration_s > 0 and forecast.spans
    assert (out / "timeline.png").is_file() and (out / "trace.json").is_file()


def test_a_run_without_a_predictor_draws_what_it_measured(tmp_path):
    graph, plan = api.plan("grpo", overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
    executor = PlanExecutor(registry())
    executor.check(graph, plan)
    out = run_dir(str(tmp_path), "grpo")
    executor.run(graph, plan, out)
    assert (out / "timeline.png").is_file()


def test_the_api_hands_a_run_the_planners_simulator(tmp_path, monkeypatch):
    graph, plan = api.plan("grpo", overrides=[*TINY, f"out={tmp_path}"], emit=lambda s: None)
    monkeypatch.setattr(api, "Simulator", Recording)
    Recording.made.clear()
    api.run(graph, plan)
    (forecast,) = Recording.made
    assert forecast.iteration_s > 0
