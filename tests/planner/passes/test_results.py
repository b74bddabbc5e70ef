"""The pass manager's typed interface: one module per pass, the caller's options as `PlanOptions`,
and each pass's by-products as typed fields of `PassResults` (``place``'s `PlaceResult`)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from flowrl import api
from flowrl.errors import ConfigError
from flowrl.planner.passes import BUILTIN_PASSES, PIPELINE, PassResults, PlanContext, PlanOptions
from flowrl.plugins.hookspecs import hookimpl
from flowrl.plugins.manager import Registry, load_plugins

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=3"]


def quiet(_: str) -> None:
    pass


@pytest.mark.parametrize("name", PIPELINE)
def test_each_builtin_pass_is_a_module_that_says_what_it_reads_and_writes(name: str) -> None:
    fn = BUILTIN_PASSES[name]
    assert fn.__module__ == f"flowrl.planner.passes.{name}"
    doc = importlib.import_module(fn.__module__).__doc__ or ""
    assert f"The ``{name}`` pass." in doc and "Reads" in doc and "writes" in doc, doc


def test_place_leaves_the_tuners_ranking_as_a_typed_result(registry: Registry) -> None:
    results = PassResults()
    _, plan = api.plan("grpo", registry=registry, overrides=SMALL, results=results, emit=quiet)
    placed = results.place
    assert placed is not None and placed.tune is not None
    assert placed.tune.considered == 1 and placed.tune.ranked[0].plan == plan.layout  # one device: one layout
    assert placed.engines == {}  # the configured generation engine: no choice made
    assert placed.unconstrained is None  # nothing required, nothing to compare


def test_a_pipeline_without_place_leaves_no_place_result(registry: Registry) -> None:
    results = PassResults()
    api.plan("grpo", registry=registry, overrides=SMALL, passes=("resolve",), results=results, emit=quiet)
    assert results.place is None


def test_an_unknown_or_mistyped_planner_option_is_refused_naming_it(registry: Registry) -> None:
    with pytest.raises(ConfigError, match="unknown field `budgt_s`.*options: budget_s, seed"):
        api.plan("grpo", registry=registry, overrides=SMALL, options={"budgt_s": 1}, emit=quiet)
    with pytest.raises(ConfigError, match=r"Expected `int`, got `str` - at `\$.seed`"):
        api.plan("grpo", registry=registry, overrides=SMALL, options={"seed": "one"}, emit=quiet)


class SeedReader:
    """A plugin pass that reads the typed options and the results of the passes before it."""

    seen: list[tuple[int, bool]] = []

    @hookimpl
    def register_passes(self, register: Any) -> None:
        def record(ctx: PlanContext, plan: Any) -> Any:
            SeedReader.seen.append((ctx.options.seed, ctx.results.place is not None))
            return plan

        register("record", record, description="records what it was given")


def test_a_plugin_pass_reads_the_typed_options_and_earlier_results() -> None:
    reg = load_plugins(entry_points=False, extra=[("seed_reader", SeedReader())])[1]
    SeedReader.seen.clear()
    options = PlanOptions(seed=7)
    _, plan = api.plan("grpo", registry=reg, overrides=SMALL, passes=(*PIPELINE, "record"), options=options, emit=quiet)
    assert SeedReader.seen == [(7, True)] and plan.passes == (*PIPELINE, "record")
