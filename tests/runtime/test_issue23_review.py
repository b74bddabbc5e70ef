"""Review of issue 23's speed work, as a demanding user meets it: the plan-time fusion of the
old-log-prob forward (``plan.fused``), the one compute thread per process (flowrl.runtime.compute),
CPU auto numerics (bfloat16 for models of 10M parameters or more) and sampling by inverse CDF
(``flowrl.backends.local.generation.draw``).

The review's bugs (a fused run losing logprob_gap, a plugin engine and hand-edited fusions, the
threads of nested runs and of ``threads``) are fixed; their tests pin the fixes. Everything here runs
tiny models for 1-4 steps.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from flowrl import api
from flowrl.errors import PlanError
from flowrl.planner import passes
from flowrl.planner.passes import verify_plan
from flowrl.planner.plan import load_plan
from flowrl.runtime.compute import on_compute_thread
from flowrl.runtime.schedule import lower

TINY = [
    "seed=1",  # a seed whose first batches have non-constant rewards (an update)
    "progress=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.mini_batches=1",  # one update per batch: the plan fuses the old-log-prob forward
    "train.micro_batch_size=5",
]
TIMING = ("step_seconds", "tokens_per_s", "spans")


def quiet(_: str) -> None:
    pass


def plan(graph: str = "grpo", *sets: str, steps: int = 2, **kwargs: Any):
    return api.plan(graph, overrides=[*TINY, f"steps={steps}", *sets], emit=quiet, **kwargs)


def unfused(p, out: Path):
    """The same plan with the fusion taken out (what ran before issue 23), to run in ``out``."""
    return msgspec.structs.replace(p, fused={}).with_run_settings({"out": str(out)})


def stable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING and not k.endswith("/seconds")} for r in metrics]


@pytest.fixture(scope="module")
def fused_run(tmp_path_factory):
    """One fused GRPO run of two steps (with its reference model: algo.kl_coef > 0)."""
    g, p = plan()
    assert p.fused == {"old_logprobs": "train_actor"}
    out = tmp_path_factory.mktemp("fused")
    return g, p, api.run(g, p.with_run_settings({"out": str(out)}))


# ---------------------------------------------------------------------------- fusion: what is planned


@pytest.mark.parametrize(
    ("sets", "fused"),
    [
        # a node's own options decide, over the config's
        (("train.mini_batches=2", "nodes.train_actor.mini_batches=1"), {"old_logprobs": "train_actor"}),
        (("nodes.train_actor.mini_batches=2",), {}),
        (("train.epochs=3", "nodes.train_actor.epochs=1"), {"old_logprobs": "train_actor"}),
        (("nodes.train_actor.epochs=2",), {}),
        (("algo.kl_coef=0",), {"old_logprobs": "train_actor"}),  # no reference model: still fused
    ],
)
def test_a_nodes_own_epochs_and_mini_batches_decide_the_fusion(sets, fused):
    g, p = plan("grpo", *sets)
    assert p.fused == fused
    names = {t.name for t in lower(g, p).tasks}
    assert ("old_logprobs" in names) == (not fused)
    if not fused:  # the unfused forward keeps its task and the train node still waits on it
        assert "old_logprobs" in next(t for t in lower(g, p).tasks if t.name == "train_actor").deps


def test_explain_says_what_is_fused_and_prices_no_pass_for_it(capsys):
    from flowrl.cli import main

    assert main(["plan", "grpo", *[a for s in TINY for a in ("--set", s)], "--explain"]) == 0
    out = capsys.readouterr().out
    assert "fused: 'old_logprobs' is computed by 'train_actor' in its own forward" in out
    per_node = out.split("per node", 1)[1].split("device groups", 1)[0]
    assert "train_actor" in per_node and "old_logprobs" not in per_node


# ---------------------------------------------------------------------------- fusion: what a run reports


def test_a_fused_run_has_no_old_logprob_pass_but_trains_on_the_ratio_one(fused_run):
    _, _, result = fused_run
    for record in result.metrics:
        assert "old_logprobs" not in record["spans"] and "train_actor" in record["spans"]
        assert not any(k.startswith("old_logprobs/") for k in record)
        # its old log-probs are its own, detached: on-policy the PPO ratio is exactly one
        assert record["train_actor/ratio_mean"] == 1.0 and record["train_actor/clipfrac"] == 0.0


def test_a_fused_run_still_reports_the_sampler_vs_trainer_logprob_gap(fused_run):
    _, _, result = fused_run
    assert all(isinstance(r.get("logprob_gap"), float) for r in result.metrics)


# ---------------------------------------------------------------------------- fusion: same update


def test_fused_equals_separate_forward_with_lora_packing_and_one_step_off(tmp_path):
    """One update per batch on LoRA adapters, packed micro-batches under a token budget, generation one
    step ahead: the fused step trains as the separate forward did (same samples, same weights)."""
    sets = ("train.lora.rank=4", "train.pack=true", "train.max_tokens_per_micro_batch=48", "rollout.mode=one_step_off")
    g, p = plan("grpo", *sets, steps=3)
    assert p.fused == {"old_logprobs": "train_actor"}
    a = api.run(g, p.with_run_settings({"out": str(tmp_path / "fused")}))
    sep = unfused(p, tmp_path / "separate")
    b = api.run(api.graph_for_plan(sep), sep)
    assert [r["reward"] for r in a.metrics] == [r["reward"] for r in b.metrics]
    for ra, rb in zip(a.metrics, b.metrics, strict=True):
        assert ra["train_actor/loss"] == pytest.approx(rb["train_actor/loss"], abs=1e-5)
        assert ra["train_actor/is_mean"] == pytest.approx(rb["train_actor/is_mean"], abs=1e-5)
    assert a.metrics[1]["train_actor/offpolicy_frac"] > 0  # one step off: the behaviour policy is older
    wa = load_file(str(a.checkpoints["actor"] / "model.safetensors"))
    wb = load_file(str(b.checkpoints["actor"] / "model.safetensors"))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5


@pytest.mark.parametrize("mode", ["streaming", "partial+async"])
def test_fused_equals_separate_forward_when_scoring_streams_or_rollouts_continue(tmp_path, mode):
    """Streaming starts scoring forward nodes on parts of the responses (the fused forward is one of
    them, with no task); partial rollouts continue responses across steps."""
    g, p = plan("grpo", f"rollout.mode={mode}", "checkpoint=false", steps=2)
    assert p.fused == {"old_logprobs": "train_actor"}
    a = api.run(g, p.with_run_settings({"out": str(tmp_path / "fused")}))
    sep = unfused(p, tmp_path / "separate")
    b = api.run(api.graph_for_plan(sep), sep)
    for ra, rb in zip(a.metrics, b.metrics, strict=True):
        assert ra["reward"] == rb["reward"]
        assert ra["train_actor/loss"] == pytest.approx(rb["train_actor/loss"], abs=1e-5)
        assert ra["train_actor/grad_norm"] == pytest.approx(rb["train_actor/grad_norm"], rel=1e-4)
        assert "old_logprobs" not in ra["spans"] and "old_logprobs" in rb["spans"]


class Stop(Exception):
    pass


def test_a_fused_run_stopped_by_ctrl_c_resumes_to_the_uninterrupted_run(tmp_path):
    """Ctrl-C (SIGINT to this process, handled by the run on the main thread while the engines compute
    on the compute thread) stops after the current step with a checkpoint; --resume then gives the
    metrics of the run that was never stopped."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the run installs its Ctrl-C handler on the main thread only")
    g, p = plan("grpo", "save_every=0", steps=4)
    assert p.fused
    whole = api.run(g, p.with_run_settings({"out": str(tmp_path / "whole")}))
    sent = []

    def ctrl_c(record: dict) -> None:
        if record["step"] == 1 and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)

    first = api.run(g, p.with_run_settings({"out": str(tmp_path / "part")}), on_step=ctrl_c)
    folder = first.out_dir
    assert first.stopped is not None and first.stopped < 3 and first.last_checkpoint is not None
    resumed = api.run(g, load_plan(folder / "plan.yaml"), out_dir=folder, resume=True)
    assert resumed.resumed_from == first.stopped + 1
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    assert stable(lines) == stable(whole.metrics)


# ---------------------------------------------------------------------------- fusion: plan edits


def test_a_plan_fusing_another_models_forward_is_refused():
    g, p = plan("grpo")
    assert "ref_logprobs" in g.nodes
    edited = msgspec.structs.replace(p, fused={**p.fused, "ref_logprobs": "train_actor"}).sealed()
    with pytest.raises(PlanError, match="ref_logprobs"):
        verify_plan(g, edited)


def test_a_stale_fusion_in_a_plan_of_two_updates_per_batch_is_refused():
    g, p = plan("grpo", "train.mini_batches=2")
    assert p.fused == {} and p.options["train_actor"].options["mini_batches"] == 2
    edited = msgspec.structs.replace(p, fused={"old_logprobs": "train_actor"}).sealed()
    with pytest.raises(PlanError, match="old_logprobs"):
        verify_plan(g, edited)


def test_a_plan_file_edited_to_add_a_fusion_keeps_its_id_check(tmp_path):
    """Adding a fusion to a written plan changes its content: refused unless the id line goes."""
    _, p = plan("grpo", "train.mini_batches=2")
    path = tmp_path / "plan.yaml"
    text = msgspec.yaml.encode(p).decode().replace("fused: {}", "fused:\n  old_logprobs: train_actor")
    assert "old_logprobs: train_actor" in text
    path.write_text(text)
    with pytest.raises(Exception, match="edited"):
        load_plan(path)


# ---------------------------------------------------------------------------- fusion: other engines
# (a plugin engine that declares no own outputs: tests/runtime/test_runtime_boundary.py, with its fake engine)


# ---------------------------------------------------------------------------- the compute thread


def _threads_seen(tmp_path: Path, *sets: str) -> list[tuple[str, int, int]]:
    g, p = plan("grpo", "checkpoint=false", *sets, steps=1)
    seen: list[tuple[str, int, int]] = []

    def on_step(_: dict) -> None:  # called on the run's caller thread
        seen.append(
            (threading.current_thread().name, torch.get_num_threads(), on_compute_thread(torch.get_num_threads))
        )

    before = torch.get_num_threads()
    api.run(g, p.with_run_settings({"out": str(tmp_path)}), on_step=on_step)
    assert torch.get_num_threads() == before  # the caller's count comes back
    return seen


def test_the_callers_thread_computes_serially_during_a_run(tmp_path):
    ((name, caller, compute),) = _threads_seen(tmp_path)
    assert name == threading.current_thread().name and caller == 1


def test_the_callers_thread_computes_serially_with_threads_configured(tmp_path):
    ((_, caller, compute),) = _threads_seen(tmp_path, "threads=2")
    assert compute == 2  # the engines compute with the configured count
    assert caller == 1


def test_a_nested_run_leaves_the_outer_runs_compute_threads_alone(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the outer run's engines compute on two threads (tests default to one)
    try:
        g, p = plan("grpo", "checkpoint=false", steps=2)
        counts: list[int] = []

        def on_step(record: dict) -> None:
            counts.append(on_compute_thread(torch.get_num_threads))
            if record["step"] == 0:  # e.g. a quick side run from a callback
                gi, pi = plan("grpo", "checkpoint=false", "rollout.prompts_per_step=1", steps=1)
                api.run(gi, pi.with_run_settings({"out": str(tmp_path / "inner")}))

        api.run(g, p.with_run_settings({"out": str(tmp_path / "outer")}), on_step=on_step)
        assert counts[0] == 2
        assert counts[1] == 2
    finally:
        torch.set_num_threads(before)


def test_a_run_after_a_failed_run_in_the_same_process_equals_a_fresh_one(tmp_path):
    """A run that fails mid-way (its caller raising while the next step's work is in flight) leaves the
    compute thread usable: the next run in the process gives the metrics the first run gave."""
    g, p = plan("grpo", "checkpoint=false", steps=2)
    first = api.run(g, p.with_run_settings({"out": str(tmp_path / "a")}))

    def fail(record: dict) -> None:
        raise Stop

    with pytest.raises(Stop):
        api.run(g, p.with_run_settings({"out": str(tmp_path / "b")}), on_step=fail)
    again = api.run(g, p.with_run_settings({"out": str(tmp_path / "c")}))
    assert stable(again.metrics) == stable(first.metrics)
    assert on_compute_thread(threading.current_thread).name.startswith("flowrl-compute")


def test_a_non_finite_fused_step_on_the_compute_thread_stops_naming_the_node_and_step(tmp_path, monkeypatch):
    """The train step (its own forward computing the old log-probs) runs on the compute thread; a
    non-finite loss there still stops the run naming the node and the step (README)."""
    from flowrl.backends.local import engine

    real = engine.LocalModel._outputs

    def poisoned(self, seqs, output):
        out = real(self, seqs, output)
        return out * float("nan") if torch.is_grad_enabled() else out  # the train step's forward only

    monkeypatch.setattr(engine.LocalModel, "_outputs", poisoned)
    g, p = plan("grpo", "checkpoint=false", steps=1)
    assert p.fused
    with pytest.raises(Exception, match=r"node 'train_actor'.*not finite.*\(step 0\)"):
        api.run(g, p.with_run_settings({"out": str(tmp_path)}))


# ---------------------------------------------------------------------------- CPU auto numerics


@pytest.mark.parametrize("native", [True, False])
def test_cpu_auto_numerics_follow_the_models_size(monkeypatch, native):
    monkeypatch.setattr(passes, "cpu_has_bf16", lambda: native)
    big = ["tiny_model.hidden_size=512", "tiny_model.intermediate_size=1024", "tiny_model.num_layers=6"]
    _, small = plan("grpo")
    _, large = plan("grpo", *big)
    assert large.target.model.parameters() >= passes.CPU_BF16_PARAMETERS > small.target.model.parameters()
    assert {m.numerics.dtype for m in small.models.values()} == {"float32"}
    assert {m.numerics.dtype for m in large.models.values()} == {"bfloat16" if native else "float32"}
    assert {m.numerics.attention for m in large.models.values()} == {"eager"}
    _, pinned = plan("grpo", *big, "train.dtype=float32")
    assert {m.numerics.dtype for m in pinned.models.values()} == {"float32"}


# ---------------------------------------------------------------------------- sampling by inverse CDF


def test_draw_never_takes_a_token_outside_top_p_or_without_probability():
    from flowrl.backends.local.generation import draw, top_p_filter

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 4096, generator=g) * 3
    logits[:, ::7] = float("-inf")  # tokens of no probability scattered through the vocabulary
    for top_p in (1.0, 0.9, 0.3, 1e-3):
        for temperature in (1.0, 0.3, 2.5):
            probs = torch.softmax(top_p_filter(logits / temperature, top_p), -1)
            for _ in range(20):
                tok = draw(probs, g)
                assert tok.shape == (32,) and tok.dtype == torch.long
                assert bool((probs.gather(1, tok[:, None]) > 0).all()), (top_p, temperature)
            if top_p == 1e-3:  # the nucleus is the top token alone
                assert torch.equal(draw(probs, g), logits.argmax(-1))


def test_draw_matches_the_distribution_and_takes_one_random_number_a_row():
    from flowrl.backends.local.generation import draw

    probs = torch.tensor([0.0, 0.05, 0.0, 0.45, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(3)
    toks = draw(probs.repeat(40_000, 1), g)
    freq = torch.bincount(toks, minlength=7).double() / len(toks)
    assert torch.allclose(freq, probs.double(), atol=0.008)  # > 3 sigma of a 40000-draw frequency
    assert float(freq[[0, 2, 6]].sum()) == 0.0
    # one uniform a row: the generator ends where 5 uniforms leave it, whatever the vocabulary
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    draw(torch.softmax(torch.randn(5, 50_000), -1), a)
    torch.rand((5, 1), generator=b)
    assert torch.equal(a.get_state(), b.get_state())
    # an unnormalised row (a sum off by rounding) is drawn from its own total
    assert int(draw(torch.tensor([[0.0, 2.0, 0.0]]), g)) == 1


def test_greedy_sampling_is_argmax_decoding_and_draws_nothing():
    from flowrl.backends.local.generation import sample

    class Echo(torch.nn.Module):
        """A model whose next-token logits are a fixed function of the last token."""

        def __init__(self) -> None:
            super().__init__()
            self.table = torch.randn(11, 11, generator=torch.Generator().manual_seed(1))

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=True, past_key_values=None):
            cache = past_key_values if past_key_values is not None else _Cache()
            return types.SimpleNamespace(logits=self.table[input_ids], past_key_values=cache)

    model = Echo()
    ids = torch.tensor([[3, 4], [5, 6]])
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    tokens, logprobs, alive = sample(
        model, ids, torch.ones_like(ids), max_new_tokens=5, eos_id=10, pad_id=0, greedy=True, generator=g,
        ignore_eos=True,
    )  # fmt: skip
    assert torch.equal(g.get_state(), state)  # greedy draws no random number
    last = ids[:, -1]
    for step in range(tokens.shape[1]):
        want = model.table[last].argmax(-1)
        assert torch.equal(tokens[:, step], want)
        assert torch.allclose(
            logprobs[:, step], torch.log_softmax(model.table[last], -1).gather(1, want[:, None])[:, 0]
        )
        last = want
    # sampled, at a near-zero temperature, the draw agrees with argmax
    hot, _, _ = sample(
        model, ids, torch.ones_like(ids), max_new_tokens=5, eos_id=10, pad_id=0, temperature=1e-4, generator=g,
        ignore_eos=True,
    )  # fmt: skip
    assert torch.equal(hot, tokens)


class _Cache:
    def batch_select_indices(self, index: torch.Tensor) -> None:
        pass
