"""Rollout modes are schedules of the same graph: the versioned rollout buffer keeps the
staleness bound, partial rollouts lose and repeat no prompt and resume exactly, importance
weights are exactly 1 on-policy, and one-step-off with eta = 0 is sync."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl import api
from flowrl.algorithms.losses import behaviour_weights
from flowrl.contract.data import Prompt, Rollout, Sequences
from flowrl.errors import ConfigError, PlanError
from flowrl.planner.space import RolloutPolicy
from flowrl.plugins.manager import registry
from flowrl.runtime.batch import ragged
from flowrl.runtime.executor import PlanExecutor, run_dir
from flowrl.runtime.rollout import StepRollout
from flowrl.tasks.builtin import make_task

TINY = [
    "seed=0",
    "progress=false",
    "checkpoint=false",
    "task=repeat",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=2",
    "rollout.chunk_tokens=4",
    "rollout.stream_groups=1",
]


def run(tmp_path, mode: str | None, *extra: str, steps: int = 3, graph: str = "grpo"):
    overrides = [*TINY, f"steps={steps}", f"out={tmp_path}", *extra]
    if mode is not None:
        overrides.append(f"rollout.mode={mode}")
    g, plan = api.plan(graph, overrides=overrides, emit=lambda s: None)
    executor = PlanExecutor(registry())
    executor.check(g, plan)
    return plan, executor, executor.run(g, plan, run_dir(str(tmp_path), graph))


# ------------------------------------------------------------------ a generation engine for property tests


class ScriptedEngine:
    """Generation whose responses end at random (drawn from the test's rng) and whose weight
    version moves at random between calls: the timings the buffer must be robust to. Each token
    is the row's prompt length (so a token's origin is checkable); log-probs are -1."""

    resumable = True

    def __init__(self, rng: random.Random, eos_chance: float, limit: int) -> None:
        self.rng, self.eos_chance, self.limit, self.version = rng, eos_chance, limit, 0

    def _extend(self, seqs: Sequences, logprobs: torch.Tensor, finished: torch.Tensor, budget: int) -> Rollout:
        rows = []
        for i in range(len(seqs)):
            have = int(seqs.response_mask[i].sum())
            toks = seqs.response_ids[i, :have].tolist()
            done = bool(finished[i])
            for _ in range(budget):
                if done or len(toks) >= self.limit:
                    break
                toks.append(int(seqs.prompt_mask[i].sum()))
                done = self.rng.random() < self.eos_chance
            rows.append((toks, done or len(toks) >= self.limit))
        width = max(len(t) for t, _ in rows)
        ids = ragged([t for t, _ in rows], width, 0, torch.long)
        mask = ragged([[1.0] * len(t) for t, _ in rows], width, 0.0, torch.float32)
        out = Sequences(
            prompt_ids=seqs.prompt_ids,
            prompt_mask=seqs.prompt_mask,
            response_ids=ids,
            response_mask=mask,
            prompt_index=seqs.prompt_index,
            texts=tuple("x" * len(t) for t, _ in rows),
        )
        return Rollout(sequences=out, logprobs=-mask, finished=torch.tensor([d for _, d in rows]))

    def generate(self, prompts, *, n, greedy, generator, max_new_tokens=None):
        lengths = [len(p.text) for p in prompts for _ in range(n)]
        width = max(lengths)
        ids = torch.ones(len(lengths), width, dtype=torch.long)
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        for i, k in enumerate(lengths):
            mask[i, width - k :] = 1
        empty = torch.zeros(len(lengths), 0, dtype=torch.long)
        seqs = Sequences(
            prompt_ids=ids,
            prompt_mask=mask,
            response_ids=empty,
            response_mask=empty.float(),
            prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
            texts=("",) * len(lengths),
        )
        return self._extend(seqs, empty.float(), torch.zeros(len(lengths), dtype=torch.bool), max_new_tokens or 99)

    def resume(self, rollout, *, generator, max_new_tokens=None):
        return self._extend(rollout.sequences, rollout.logprobs, rollout.finished, max_new_tokens or 99)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    eta=st.integers(1, 3),
    mode=st.sampled_from(["sync", "one_step_off", "async"]),
    overprovision=st.sampled_from([0.0, 0.5, 1.0]),
    eos=st.sampled_from([0.1, 0.3, 0.6]),
)
def test_buffer_never_hands_training_a_sample_older_than_eta(seed, eta, mode, overprovision, eos):
    """Random response lengths and weight updates at random moments (between any two decode
    chunks, as far as the policy's lead allows): every batch respects the bound, every prompt
    is trained once, and drawn = trained + in flight."""
    rng = random.Random(seed)
    engine = ScriptedEngine(rng, eos, limit=12)
    policy = RolloutPolicy(mode=mode, staleness=eta, partial=True, overprovision=overprovision)
    task = make_task("repeat", {})
    stream = random.Random(seed)
    source = StepRollout(
        model="actor",
        generator=engine,
        n=2,
        greedy=False,
        policy=policy,
        prompts_per_step=3,
        chunk_tokens=2,
        stream_groups=1,
        pad_id=0,
        draw=lambda k: task.prompts(stream, k),
    )
    for step in range(8):
        trained_at = step  # the version this batch is trained at
        engine.version = max(engine.version, trained_at - policy.lead)  # generation may start this far behind
        coro = source.run(step, trained_at, None, torch.Generator())
        while True:
            if rng.random() < 0.5 and engine.version < trained_at:
                engine.version += 1  # a weight sync slipped in between two chunks
            try:
                next(coro)
            except StopIteration as stop:
                result = stop.value
                prompts, seqs, metrics = result.prompts, result.sequences, result.metrics
                break
        assert len(prompts) == 3 and len(seqs) == 6
        oldest = torch.where(seqs.response_mask.bool(), seqs.versions, trained_at).min(-1).values
        assert int(oldest.min()) >= trained_at - eta, (step, seqs.versions)
        assert metrics["staleness_max"] <= eta
        # every token's origin is its own row's prompt (rows never mix when carried over)
        for i in range(len(seqs)):
            k = int(seqs.prompt_mask[i].sum())
            toks = seqs.response_ids[i][seqs.response_mask[i].bool()]
            assert (toks == k).all()
    buf = source.buffer
    assert len(buf.taken) == len(set(buf.taken)) == 8 * 3
    assert buf.drawn == len(buf.taken) + len(buf.groups())
    assert set(range(buf.drawn)) == set(buf.taken) | set(buf.groups())


def test_a_row_too_old_is_restarted_from_its_prompt():
    policy = RolloutPolicy(mode="sync", staleness=1, partial=True, overprovision=1.0)
    engine = ScriptedEngine(random.Random(0), eos_chance=0.0, limit=50)  # nothing finishes on its own
    task = make_task("repeat", {})
    stream = random.Random(0)
    source = StepRollout("actor", engine, 1, False, policy, 1, 2, 1, 0, lambda k: task.prompts(stream, k))
    coro = source.run(0, 0, None, torch.Generator())
    for _ in range(3):
        next(coro)
    assert all(len(r.tokens) == 6 for r in source.buffer.rows)
    assert source.buffer.enforce(2, 2) == 2  # their first tokens are version 0: too old for a batch at version 2
    assert all(r.tokens == [] and r.started == 2 for r in source.buffer.rows)
    assert source.buffer.drawn == 2 and source.buffer.taken == []  # the prompts stay


# ------------------------------------------------------------------ the real engine


@pytest.fixture(scope="module")
def actor():
    g, plan = api.plan("grpo", overrides=[*TINY, "steps=1"], emit=lambda s: None)
    trainers, generators = PlanExecutor(registry()).engines(g, plan)
    return generators["actor"]


@pytest.mark.slow
def test_greedy_abort_and_resume_through_the_buffer_gives_the_uninterrupted_tokens(actor):
    """Partial rollouts with 2-token chunks abort unfinished responses at every step and continue
    them later; under greedy decoding every trained response equals one uninterrupted generation."""
    prompts = make_task("repeat", {}).prompts(random.Random(3), 12)
    stream = iter(prompts)
    policy = RolloutPolicy(mode="sync", staleness=99, partial=True, overprovision=1.0)
    source = StepRollout("actor", actor, 1, True, policy, 3, 2, 1, 0, lambda k: [p for _, p in zip(range(k), stream)])
    trained = []
    for step in range(3):
        coro = source.run(step, 0, None, torch.Generator())
        while True:
            try:
                next(coro)
            except StopIteration as stop:
                batch_prompts, seqs = stop.value.prompts, stop.value.sequences
                break
        trained += [(p.text, seqs.texts[i]) for i, p in enumerate(batch_prompts)]
    assert source.buffer.restarts == 0 and any(r.tokens for r in source.buffer.rows)  # some were cut short
    full = actor.generate(
        [Prompt(text=t, answer="") for t, _ in trained], n=1, greedy=True, generator=torch.Generator()
    )
    assert [text for _, text in trained] == list(full.sequences.texts)


def test_importance_weights_are_exactly_one_for_tokens_of_the_current_policy():
    mask = torch.ones(2, 3)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]])
    behaviour = old + 0.01  # the sampler's log-probs differ by float noise
    w, stats = behaviour_weights(old, behaviour, torch.full((2, 3), 7), 7, mask)
    assert torch.equal(w, torch.ones(2, 3)) and stats["offpolicy_frac"] == 0.0 and stats["is_max"] == 1.0
    versions = torch.tensor([[6, 6, 7], [7, 7, 7]])
    w, stats = behaviour_weights(old, old - 10.0, versions, 7, mask, "clip", 5.0)
    assert w[0, :2].tolist() == [5.0, 5.0] and w[0, 2] == 1.0 and stats["is_clipfrac"] == pytest.approx(2 / 6)
    w, _ = behaviour_weights(old, old, versions, 7, mask, "mask")
    assert w[0].tolist() == [0.0, 0.0, 1.0] and (w[1] == 1).all()


def _records(result):
    return [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]


TIMING = ("step_seconds", "tokens_per_s", "spans")


@pytest.mark.slow
def test_one_step_off_with_eta_zero_is_sync(tmp_path):
    _, _, sync = run(tmp_path / "a", None)
    _, _, off = run(tmp_path / "b", "one_step_off", "rollout.staleness=0")
    for a, b in zip(_records(sync), _records(off), strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    for record in _records(sync):  # on-policy: every importance weight is exactly 1
        assert record["train_actor/is_mean"] == 1.0 and record["train_actor/is_max"] == 1.0
        assert record["rollout/staleness_0"] == 1.0


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "mode",
    ["one_step_off", *(pytest.param(m, marks=SLOW) for m in ("async", "partial", "partial+async", "streaming"))],
)
@pytest.mark.slow
def test_every_mode_runs_locally_within_its_bound(tmp_path, mode):
    plan, executor, result = run(tmp_path, mode, steps=4)
    eta = plan.layout.rollout.staleness
    records = _records(result)
    assert len(records) == 4
    for r in records:
        assert r["rollout/samples"] == 8 and r["rollout/staleness_max"] <= eta
        assert sum(r[f"rollout/staleness_{a}"] for a in range(eta + 1)) == pytest.approx(1.0)
        assert r["train_actor/is_max"] >= 1.0 or r["train_actor/offpolicy_frac"] > 0
    buf = executor.sources["rollout"].buffer
    assert len(buf.taken) == len(set(buf.taken)) == 4 * 4  # no prompt trained twice, none lost
    assert buf.drawn == len(buf.taken) + len(buf.groups())
    if "partial" in mode:
        assert any(r["rollout/recycled_tokens"] > 0 for r in records)
    if mode != "streaming" and mode != "partial":  # generation ran ahead of training: samples one version old
        assert any(r["rollout/staleness_1"] > 0 for r in records)
    if mode == "streaming":  # scoring started on parts while generation went on
        assert any(r["reward/parts"] > 1 for r in records)
        trace = json.loads((result.out_dir / "trace.json").read_text())["traceEvents"]
        spans = [e for e in trace if e.get("ph") == "X" and e.get("pid") == 0]
        gen = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "rollout"]
        reward = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "reward"]
        assert any(r0 < g1 and r0 > g0 for r0, _ in reward for g0, g1 in gen) or len(reward) > len(gen)


def test_mode_mistakes_are_named(tmp_path):
    with pytest.raises(ConfigError, match="rollout.mode.*'parital'.*partial"):
        api.plan("grpo", overrides=[*TINY, "rollout.mode=parital"], emit=lambda s: None)
    with pytest.raises(ConfigError, match="at most one of"):
        api.plan("grpo", overrides=[*TINY, "rollout.mode=async+one_step_off"], emit=lambda s: None)
    with pytest.raises(PlanError, match="rollout.staleness >= 1"):
        api.plan("grpo", overrides=[*TINY, "rollout.mode=partial", "rollout.staleness=0"], emit=lambda s: None)
    with pytest.raises(PlanError, match="one generate node.*remax"):  # refused when planned
        api.plan("remax", overrides=[*TINY, "rollout.mode=partial", "steps=1"], emit=lambda s: None)
