"""Whole runs: the shipped graphs really learn the toy task with a fixed seed.

These are the heaviest tests (about a minute each on 2 cores); they run in CI.
"""

from __future__ import annotations

import json

import pytest
import torch

from flowrl import api
from flowrl.backends.local.models import build_causal_lm, load_tokenizer, model_config
from flowrl.specs import TinyModelConfig

pytestmark = pytest.mark.slow


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


def train(graph: str, tmp_path, steps: int, *extra: str):
    overrides = [f"steps={steps}", "seed=0", "progress=false", f"out={tmp_path}", *extra]
    g, plan = api.plan(graph, overrides=overrides, emit=lambda s: None)
    return api.run(g, plan)


def test_grpo_learns_copy_and_writes_a_loadable_checkpoint(tmp_path):
    result = train("graphs/grpo.py", tmp_path, 120)
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"GRPO copy: reward {first:.3f} -> {last:.3f}")
    assert first < 0.2
    assert last > 0.6
    lines = (result.out_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 120 and json.loads(lines[-1])["step"] == 119
    assert (result.out_dir / "reward.png").read_bytes()[:4] == b"\x89PNG"
    ckpt = result.checkpoints["actor"]
    tok = load_tokenizer(str(ckpt))
    model = build_causal_lm(str(ckpt), model_config(str(ckpt), TinyModelConfig(), tok), seed=0)
    enc = tok(["cab>"], return_tensors="pt")
    trained = result.metrics  # the loaded weights are the trained ones: greedy decoding copies
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=5, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.startswith("c"), (text, trained[-1]["sample"])


def test_same_seed_same_curve(tmp_path):
    a = train("grpo", tmp_path / "a", 4, "rollout.prompts_per_step=4", "checkpoint=false")
    b = train("grpo", tmp_path / "b", 4, "rollout.prompts_per_step=4", "checkpoint=false")
    assert [m["reward"] for m in a.metrics] == [m["reward"] for m in b.metrics]
    assert [m["train_actor/loss"] for m in a.metrics] == [m["train_actor/loss"] for m in b.metrics]


def test_ppo_learns(tmp_path):
    result = train("graphs/ppo.py", tmp_path, 150, "checkpoint=false")
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"PPO copy: reward {first:.3f} -> {last:.3f}")
    assert last > first + 0.3
    assert "train_critic/loss" in result.metrics[-1]


@pytest.mark.parametrize("graph", ["rloo", "remax", "reinforce_pp"])
def test_other_graphs_run_and_improve(graph, tmp_path):
    result = train(graph, tmp_path, 60, "checkpoint=false")
    rewards = [m["reward"] for m in result.metrics]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.1, rewards
