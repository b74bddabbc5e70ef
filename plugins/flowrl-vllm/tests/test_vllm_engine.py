"""The vLLM generation engine against the torch training engine: after an in-place weight update
its sampling log-probs equal the training forward pass (fp32), resumed rows continue from their
tokens, and sampling is reproducible from the step's generator. Skipped where vLLM is not
installed (see plugins/flowrl-vllm/README.md)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from flowrl_vllm.engine import VLLMEngine  # noqa: E402

from flowrl import api  # noqa: E402
from flowrl.runtime.protocols import EngineContext  # noqa: E402
from flowrl.tasks.builtin import Prompt  # noqa: E402

HEADS = ["progress=false", "tiny_model.num_heads=2", "tiny_model.num_kv_heads=1", "rollout.max_new_tokens=8"]
PROMPTS = [Prompt(text="abc>", answer="abc"), Prompt(text="ba>", answer="ba")]


@pytest.fixture(scope="module")
def engines():
    graph, plan = api.plan("grpo", overrides=HEADS, emit=lambda s: None)
    trainers, _ = api.check(graph, plan).engines(graph, plan)
    actor = trainers["actor"]
    engine = VLLMEngine(EngineContext(decl=graph.models["actor"], plan=plan, device="cpu", source=actor))
    return actor, engine


def _gap(actor, rollout) -> float:
    seqs = rollout.sequences
    ref = actor.forward(seqs, "logprobs", 0)
    return float(((ref - rollout.logprobs) * seqs.response_mask).abs().max())


def test_logprobs_match_the_training_forward_after_an_in_place_update(engines):
    actor, engine = engines
    out = engine.generate(PROMPTS, n=3, greedy=False, generator=torch.Generator().manual_seed(0))
    assert out.sequences.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert _gap(actor, out) < 1e-4
    with torch.no_grad():
        for p in actor.module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
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
