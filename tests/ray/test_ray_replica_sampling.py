"""What two generation replicas on Ray sample: each replica takes its own contiguous share of the
prompts (every prompt's samples stay on one replica, so GRPO groups stay whole) and draws with its own
seed (the step's seed + its replica index), exactly as one process would sample those prompts with
that seed; the replicas' draws are not the same random numbers.

One Ray session serves the module (the executor joins it instead of starting its own).
"""

from __future__ import annotations

import random

import pytest
import torch

from flowrl import api
from flowrl.plugins.manager import registry
from flowrl.runtime import dispatch
from flowrl.runtime.executor import PlanExecutor
from flowrl.runtime.groups import GenerationGroup
from flowrl.tasks.builtin import Copy

ray = pytest.importorskip("ray")

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "progress=false", "checkpoint=false"]

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_two_replicas_sample_their_own_prompts_with_their_own_seeds_as_one_process_would(tmp_path):
    overrides = [*SMALL, "backend=ray", "device=cpu", f"out={tmp_path}"]
    _, cfg = api.load("grpo", overrides=overrides)
    target = api.local_target(cfg, registry(), devices=2)
    g2, plan2 = api.plan(
        "grpo", overrides=overrides, target=target, for_backend=True, options={"placement": "colocate"},
        emit=lambda s: None,
    )  # fmt: skip
    assert plan2.layout.generation_of("actor").replicas == 2
    ex = api.check(g2, plan2)
    sched = ex.schedule(g2, plan2)
    transport, built = ex.launch(g2, plan2, sched, tmp_path)
    try:
        tokenizer = built["actor"][0]
        group = GenerationGroup("actor", sched.generation_ranks("actor"), transport, tokenizer.pad_token_id)
        assert len(group.replicas) == 2
        g1, plan1 = api.plan("grpo", overrides=[*SMALL, "device=cpu"], emit=lambda s: None)
        local = PlanExecutor(registry()).engines(g1, plan1)[1]["actor"]  # one process, the same initial weights

        prompts, n = Copy().prompts(random.Random(0), 6), 4
        rollout = group.generate(prompts, n=n, greedy=False, generator=torch.Generator().manual_seed(3))
        seed = dispatch.draw_seed(torch.Generator().manual_seed(3))  # what the group drew for this call
        seqs = rollout.sequences
        # every prompt's samples on one replica, in prompt order: groups are whole
        assert seqs.prompt_index.tolist() == torch.arange(len(prompts)).repeat_interleave(n).tolist()

        cuts = dispatch.shards(len(prompts), 2)
        for i, cut in enumerate(cuts):
            rows = slice(cut.start * n, cut.stop * n)
            own = local.generate(prompts[cut], n=n, greedy=False, generator=torch.Generator().manual_seed(seed + i))
            assert seqs.texts[rows] == own.sequences.texts, f"replica {i} did not sample as one process with its seed"
            width = own.logprobs.shape[1]
            assert torch.allclose(rollout.logprobs[rows, :width], own.logprobs, atol=1e-5)
            if i > 0:  # the replicas do not share a random stream: replica 0's seed gives other samples here
                same = local.generate(prompts[cut], n=n, greedy=False, generator=torch.Generator().manual_seed(seed))
                assert same.sequences.texts != own.sequences.texts
    finally:
        transport.close()
