"""The README's main job, run in this process: it learns and writes a loadable checkpoint (slow:
the full suite runs it). Its own module, so the test runners share the slow runs out evenly."""

from __future__ import annotations

import json
import random
from statistics import mean

import pytest
import torch

from flowrl import api
from flowrl.backends.local.models import build_causal_lm, load_tokenizer, model_config
from flowrl.specs import TinyModelConfig
from flowrl.tasks.builtin import Copy

pytestmark = pytest.mark.slow


def test_main_job_grpo_learns_copy_and_writes_a_loadable_checkpoint(tmp_path):
    """The README's main job with its defaults, for its first 160 steps: reward from < 0.2 to > 0.7
    (seed 0, one torch thread: 0.027 -> 0.77; greedy decoding from the checkpoint 0.90)."""
    overrides = ["steps=160", "progress=false", f"out={tmp_path}"]
    g, plan = api.plan("graphs/grpo.py", overrides=overrides, emit=lambda s: None)
    result = api.run(g, plan)
    rewards = [m["reward"] for m in result.metrics]
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    print(f"GRPO copy, {len(rewards)} steps: reward {first:.3f} -> {last:.3f}")
    assert first < 0.2
    assert last > 0.7
    lines = (result.out_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == plan.config.steps and json.loads(lines[-1])["step"] == plan.config.steps - 1
    assert (result.out_dir / "reward.png").read_bytes()[:4] == b"\x89PNG"
    # The checkpoint is the trained policy: greedy decoding from the reloaded files copies.
    ckpt = result.checkpoints["actor"]
    tok = load_tokenizer(str(ckpt))
    model = build_causal_lm(str(ckpt), model_config(str(ckpt), TinyModelConfig(), tok), seed=0)
    task = Copy()
    prompts = task.prompts(random.Random(123), 16)
    enc = tok([p.text for p in prompts], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=task.max_new_tokens(),
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    greedy = mean(task.score(p, t) for p, t in zip(prompts, texts))
    print(f"reloaded checkpoint, greedy: {greedy:.3f}")
    assert greedy > 0.6


def test_same_seed_same_curve(tmp_path):
    def run(out):
        overrides = ["steps=4", "seed=0", "progress=false", f"out={out}", "rollout.prompts_per_step=4"]
        overrides.append("checkpoint=false")
        g, plan = api.plan("grpo", overrides=overrides, emit=lambda s: None)
        return api.run(g, plan)

    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    assert [m["reward"] for m in a.metrics] == [m["reward"] for m in b.metrics]
    assert [m["train_actor/loss"] for m in a.metrics] == [m["train_actor/loss"] for m in b.metrics]
