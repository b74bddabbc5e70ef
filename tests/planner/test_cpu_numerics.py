"""The planner's CPU numerics: float32 for tiny models; bfloat16 (eager attention) for models of
`CPU_BF16_PARAMETERS` or more where the CPU computes bfloat16 natively; a configured dtype wins."""

from __future__ import annotations

import pytest

from flowrl import api
from flowrl.planner.passes import numerics

TINY = ["progress=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"]


def plan(graph: str, *sets: str):
    return api.plan(graph, overrides=[*TINY, *sets], emit=lambda s: None)


@pytest.mark.parametrize("native", [True, False])
def test_cpu_auto_numerics_follow_the_models_size(monkeypatch, native):
    monkeypatch.setattr(numerics, "cpu_has_bf16", lambda: native)
    big = ["tiny_model.hidden_size=512", "tiny_model.intermediate_size=1024", "tiny_model.num_layers=6"]
    _, small = plan("grpo")
    _, large = plan("grpo", *big)
    assert large.target.model.parameters() >= numerics.CPU_BF16_PARAMETERS > small.target.model.parameters()
    assert {m.numerics.dtype for m in small.models.values()} == {"float32"}
    assert {m.numerics.dtype for m in large.models.values()} == {"bfloat16" if native else "float32"}
    assert {m.numerics.attention for m in large.models.values()} == {"eager"}
    _, pinned = plan("grpo", *big, "train.dtype=float32")
    assert {m.numerics.dtype for m in pinned.models.values()} == {"float32"}
