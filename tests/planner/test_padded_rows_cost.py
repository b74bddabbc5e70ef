"""A trainer without remove-padding (``WorkloadSpec.padded_to``: verl before its ``use_remove_padding``)
computes every row at its prompt budget plus its response budget: the planner costs its train and forward
passes, and holds their activations, at that length, while generation still decodes the real lengths."""

from __future__ import annotations

import numpy as np
import pytest

from flowrl.cli import main
from flowrl.contract.checked import SpecFieldError
from flowrl.contract.plan import load_plan
from flowrl.contract.workload import Fixed, LogNormal, sample_lengths
from flowrl.planner.simulate import MicroBatching
from flowrl.planner.workload import WorkloadSpec

SHORT = LogNormal(median=200, sigma=0.8, max=512)


def test_padded_rows_are_computed_at_the_padded_length_whatever_their_real_lengths():
    lengths = sample_lengths(SHORT, 256, np.random.default_rng(0))
    assert MicroBatching(pad_to=1536).cut(lengths, 100, 2, 1) == (2, 1536)
    assert MicroBatching(pad_to=1536, pack=True).cut(lengths, 100, 2, 1) == (2, 1536)  # nothing to pack away
    assert MicroBatching().cut(lengths, 100, 2, 1)[1] < 612  # unpadded: each micro-batch at its longest
    assert MicroBatching(max_tokens=4096, pad_to=1536).cut(lengths, 100, 8, 1) == (2, 1536)  # the budget's rows


def test_a_padded_length_shorter_than_a_row_is_refused_naming_the_field():
    with pytest.raises(SpecFieldError, match="padded_to"):
        WorkloadSpec(prompt_length=1024, response_length=Fixed(value=512), padded_to=1000)
    assert WorkloadSpec(prompt_length=1024, response_length=Fixed(value=512), padded_to=1536).padded_to == 1536


def _plan(tmp_path, name: str, padded: int | None, graph: str, *options: str):
    """`flowrl plan GRAPH --model qwen2.5-0.5b OPTIONS` for 256 prompts of ~100 + ~250 tokens (at most 612), padded
    to ``padded`` tokens a row where given."""
    work = tmp_path / f"{name}.yaml"
    work.write_text(
        "prompts_per_step: 256\nsamples_per_prompt: 1\nprompt_length: 100\n"
        "response_length: {kind: lognormal, median: 200, sigma: 0.8, max: 512}\n"
        + (f"padded_to: {padded}\n" if padded else "")
    )
    out = tmp_path / f"{name}-plan.yaml"
    assert main(["plan", graph, "--model", "qwen2.5-0.5b", "--workload", str(work), *options, "--out", str(out)]) == 0
    return load_plan(out)


PPO = ("ppo", "--cluster", "1xH20", "--require", "placement=colocate", "--set", "train.micro_batch_size=2")


def test_a_plan_for_padded_rows_costs_training_and_scoring_at_the_padded_length_and_generation_as_before(tmp_path):
    real, padded = _plan(tmp_path, "real", None, *PPO), _plan(tmp_path, "padded", 1536, *PPO)
    assert padded.workload.padded_to == 1536  # the plan records the workload it was costed for
    before, after = real.layout.predicted.breakdown, padded.layout.predicted.breakdown
    for node in ("train_actor", "train_critic", "values", "ref_logprobs", "old_logprobs"):
        # rows of ~100 + 250 tokens computed at 1536: several times the work (not exactly: fixed costs stay)
        assert after[node] > 2.5 * before[node], node
    assert after["rollout"] == pytest.approx(before["rollout"], rel=0.02)  # decoding the real lengths

    def activations(plan) -> int:
        [estimate] = plan.memory
        return estimate.breakdown["peak: node train_actor activations"]

    # a micro-batch of 2 rows held at 1536 tokens, not at the longest real row's 612 (activations ~linear in it)
    assert activations(padded) > 2 * activations(real)


@pytest.mark.slow
def test_generation_holds_its_kv_cache_at_the_real_lengths_not_the_padded_rows(tmp_path):
    # static batches of 256 sequences: a KV cache at 1536 tokens a row would hold ~2.5x the real rows' 612
    def gen_bytes(name: str, padded: int | None) -> int:
        plan = _plan(tmp_path, name, padded, "grpo", "--cluster", "2xH20", "--decode-batch", "static:256",
                     "--require", "placement=disaggregated")  # fmt: skip
        [estimate] = [e for e in plan.memory if e.group == "gen"]
        return estimate.required_bytes

    # what the tuner costed (generation decodes the real lengths) is what the memory pass checks
    assert gen_bytes("padded", 1536) == gen_bytes("real", None)
