"""The vLLM generation engine against the torch training engine: after an in-place weight update
its sampling log-probs equal the training forward pass (fp32; within bf16 rounding when it samples
in bf16), resumed rows continue from their tokens, sampling is reproducible from the step's
generator, and a second engine in one process runs in a process of its own. Skipped where vLLM
is not installed (see plugins/flowrl-vllm/README.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]  # vLLM engines start in seconds; `flowrl profile` calibrates for a minute

from flowrl_vllm.engine import VLLMEngine  # noqa: E402

from flowrl import api  # noqa: E402
from flowrl.contract import EngineContext, Prompt  # noqa: E402

HEADS = ["progress=false", "tiny_model.num_heads=2", "tiny_model.num_kv_heads=1", "rollout.max_new_tokens=8"]
PROMPTS = [Prompt(text="abc>", answer="abc"), Prompt(text="ba>", answer="ba")]


def _build(*overrides):
    graph, plan = api.plan("grpo", overrides=[*HEADS, *overrides], emit=lambda s: None)
    trainers, _ = api.check(graph, plan).engines(graph, plan)
    actor = trainers["actor"]
    engine = VLLMEngine(
        EngineContext(decl=graph.models["actor"], spec=plan.model_run("actor"), device="cpu", source=actor)
    )
    return actor, engine


@pytest.fixture(scope="module")
def engines():
    return _build()


def _gap(actor, rollout) -> float:
    seqs = rollout.sequences
    ref = actor.forward(seqs, "logprobs", 0)
    return float(((ref - rollout.logprobs) * seqs.response_mask).abs().max())


def _perturb(actor) -> None:
    with torch.no_grad():
        for p in actor.module.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def test_logprobs_match_the_training_forward_after_an_in_place_update(engines):
    actor, engine = engines
    out = engine.generate(PROMPTS, n=3, greedy=False, generator=torch.Generator().manual_seed(0))
    assert out.sequences.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert _gap(actor, out) < 1e-4
    _perturb(actor)
    before = engine.generate(PROMPTS, n=3, greedy=False, generator=torch.Generator().manual_seed(0))
    assert _gap(actor, before) > 1e-3  # the engine still has the old weights
    engine.load_weights(actor.export_weights(), version=7)
    after = engine.generate(PROMPTS, n=3, greedy=False, generator=torch.Generator().manual_seed(0))
    assert engine.version == 7 and after.sequences.version == 7
    assert _gap(actor, after) < 1e-4


def test_sampling_is_reproducible_and_resume_continues_the_rows(engines):
    actor, engine = engines
    a = engine.generate(PROMPTS, n=2, greedy=False, generator=torch.Generator().manual_seed(5))
    b = engine.generate(PROMPTS, n=2, greedy=False, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.sequences.response_ids, b.sequences.response_ids)
    part = engine.generate(PROMPTS, n=2, greedy=False, generator=torch.Generator().manual_seed(1), max_new_tokens=2)
    assert part.sequences.response_ids.shape[1] <= 2
    done = engine.resume(part, generator=torch.Generator().manual_seed(2))
    kept = part.sequences.response_ids
    assert torch.equal(done.sequences.response_ids[:, : kept.shape[1]] * part.sequences.response_mask.long(),
                       kept * part.sequences.response_mask.long())  # fmt: skip
    assert bool(done.finished.all())
    assert _gap(actor, done) < 1e-4


BF16_PROBE = """
import json, torch
from flowrl_vllm.engine import VLLMEngine
from flowrl import api
from flowrl.contract import EngineContext, Prompt
prompts = [Prompt(text="abc>", answer="abc"), Prompt(text="ba>", answer="ba")]
graph, plan = api.plan("grpo", overrides=%r, emit=lambda s: None)
trainers, generators = api.check(graph, plan).engines(graph, plan)
actor, engine = trainers["actor"], generators["actor"]
assert isinstance(engine, VLLMEngine)
def gap():
    out = engine.generate(prompts, n=3, greedy=False, generator=torch.Generator().manual_seed(3))
    ref = actor.forward(out.sequences, "logprobs", 0)
    return float(((ref - out.logprobs) * out.sequences.response_mask).abs().max())
first = gap()
with torch.no_grad():
    for p in actor.module.parameters():
        p.add_(torch.randn_like(p) * 0.05)
stale = gap()
engine.load_weights(actor.export_weights(), version=1)  # fp32 weights, cast into the bf16 engine
after = gap()
weights = {str(v.dtype) for k, v in engine.export_weights().items() if k.endswith(".weight")}
print(json.dumps({"first": first, "stale": stale, "after": after, "dtypes": sorted(weights)}))
"""


def test_bf16_sampling_stays_within_bf16_rounding_of_the_fp32_trainer_after_an_update():
    """The common production setup: fp32 master weights, a bf16 sampler. The gap is bf16's rounding
    (~1e-3), far above fp32's (~1e-7) and far below a missed sync's (~0.3). In its own process:
    vLLM allows one in-process engine per process (the fp32 one above lives in this one)."""
    overrides = [*HEADS, "generation.engine=vllm", "generation.dtype=bfloat16"]
    done = subprocess.run(
        [sys.executable, "-c", BF16_PROBE % (overrides,)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "FLOWRL_PLUGINS": "vllm"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["dtypes"] == ["torch.bfloat16"]
    assert 1e-5 < got["first"] < 2e-2
    assert got["after"] < 2e-2 < got["stale"]


def test_a_second_engine_runs_in_its_own_process_and_both_keep_working(engines):
    """vLLM's in-process engine holds process-wide parallel state (torch.distributed, world 1): a
    second engine built next to it (or next to a Ray worker's process group) gets its own process."""
    actor, first = engines
    graph, plan = api.plan("grpo", overrides=HEADS, emit=lambda s: None)
    second = VLLMEngine(
        EngineContext(decl=graph.models["actor"], spec=plan.model_run("actor"), device="cpu", source=actor)
    )
    assert first.in_process and not second.in_process
    second.load_weights(actor.export_weights(), version=3)  # through IPC into the other process
    for engine in (second, first):
        out = engine.generate(PROMPTS, n=2, greedy=False, generator=torch.Generator().manual_seed(4))
        assert _gap(actor, out) < 1e-4
    assert second.export_weights().keys() == first.export_weights().keys()


def test_bf16_is_refused_where_the_trainer_samples_itself():
    from flowrl.errors import ConfigError, PlanError

    with pytest.raises(ConfigError, match="generation.dtype"):
        api.plan("grpo", overrides=[*HEADS, "generation.engine=local", "generation.dtype=bfloat16"], emit=print)
    with pytest.raises(PlanError, match="generation.dtype=bfloat16"):  # auto, and no other engine calibrated
        api.plan("grpo", overrides=[*HEADS, "generation.dtype=bfloat16"], emit=lambda s: None)


def test_flowrl_profile_calibrates_the_vllm_engine(monkeypatch):
    """`flowrl profile` times vLLM through the engine protocol: decode factors, weight-load rate and
    the head sizes its CPU kernels run, which the planner then uses for generation.engine=vllm."""
    import time

    from flowrl.backends.local import profile
    from flowrl.backends.local.profile import calibrate_engine, peak_flops
    from flowrl.plugins.manager import set_registry

    def once(fn, repeat=5):  # one warm-up and one timed call, not repeat: what is checked is no timing
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    monkeypatch.setattr(profile, "_best", once)
    monkeypatch.setenv("FLOWRL_PLUGINS", "vllm")
    set_registry(None)  # this folder has no registry-resetting conftest: load it under the env above
    notes = []
    try:
        cal = calibrate_engine("vllm", peak_flops(256), notes.append)
    finally:
        set_registry(None)
    assert cal is not None, notes
    assert cal.kernel_overhead > 0 and 0 < cal.matmul_efficiency <= 1 and cal.load_bandwidth > 0
    assert 32 in cal.head_sizes and 16 not in cal.head_sizes
    assert any("weight load" in n for n in notes)
