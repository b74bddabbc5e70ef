"""Lowering a plan to the schedule every backend runs, and dispatch by data-parallel rank."""

from __future__ import annotations

import msgspec
import pytest
import torch

from flowrl import api
from flowrl.contract.capabilities import Capabilities
from flowrl.contract.data import Sequences
from flowrl.contract.plan import ClusterTarget
from flowrl.errors import PlanError
from flowrl.planner.hardware import HARDWARE_PRESETS, cpu_cluster
from flowrl.runtime import dispatch
from flowrl.runtime.schedule import lower

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"]


def cluster_plan(graph: str, **pins):
    _, cfg = api.load(graph, overrides=SMALL)
    # data parallel only
    caps = Capabilities(rollout_modes=("sync",), partial_rollouts=False, model_parallel=False, pipeline_parallel=False)
    target = ClusterTarget(
        cluster=cpu_cluster(HARDWARE_PRESETS["A100-80G"], 2), model=api.model_spec(cfg), capabilities=caps
    )
    return api.plan(graph, overrides=SMALL, target=target, options=pins, emit=lambda s: None)


def test_the_local_plan_lowers_to_one_rank_with_generation_in_place():
    g, plan = api.plan("grpo", overrides=SMALL, emit=lambda s: None)
    s = lower(g, plan)
    assert s.world == 1 and [x.ranks for x in s.groups] == [(0,)]
    assert s.placement("actor").in_place and not any(t.kind == "sync" for t in s.tasks)
    assert [t.name for t in s.tasks] == g.order()
    train = next(t for t in s.tasks if t.name == "train_actor")
    assert set(train.deps) == {"rollout", "old_logprobs", "ref_logprobs", "advantages"}
    assert train.model == "actor" and train.groups == (s.placement("actor").group,)
    assert next(t for t in s.tasks if t.name == "reward").groups == ()  # the controller's work
    # a different generation engine than the trainer takes the weights by a sync task, even on one rank
    s2 = lower(g, plan, same_engine=False)
    sync = next(t for t in s2.tasks if t.kind == "sync")
    assert sync.name == "sync:train_actor" and sync.deps == ("train_actor",) and sync.strategy == "reshard"


@pytest.mark.parametrize("strategy", ["full", "bucketed", "sparse"])
def test_disaggregated_generation_gets_a_sync_task_over_both_groups(strategy):
    g, plan = cluster_plan("grpo", placement="disaggregated", weight_sync=strategy)
    s = lower(g, plan)
    assert s.world == 2 and s.ranks_of("actor") != s.generation_ranks("actor")
    sync = next(t for t in s.tasks if t.kind == "sync")
    assert sync.strategy == strategy and set(sync.groups) == {"gen", "train"} and sync.deps == ("train_actor",)
    gen = next(t for t in s.tasks if t.kind == "generate")
    assert gen.groups == ("gen",) and gen.model == "actor"


def test_colocated_data_parallel_reshards_and_reshard_across_groups_is_refused():
    g, plan = cluster_plan("grpo", placement="colocate")
    s = lower(g, plan)
    assert s.placement("actor").dp == 2 and not s.placement("actor").in_place
    assert next(t for t in s.tasks if t.kind == "sync").strategy == "reshard"
    g2, split = cluster_plan("grpo", placement="disaggregated", weight_sync="full")
    bad = msgspec.structs.replace(
        split,
        layout=msgspec.structs.replace(
            split.layout, weight_sync=msgspec.structs.replace(split.layout.weight_sync, strategy="reshard")
        ),
    )
    with pytest.raises(PlanError, match="reshard.*'actor' trains on 'train' and generates on 'gen'"):
        lower(g2, bad)


def test_shards_rank_rows_and_micro_batches():
    assert [(s.start, s.stop) for s in dispatch.shards(5, 2)] == [(0, 3), (3, 5)]
    assert [s.stop - s.start for s in dispatch.shards(1, 3)] == [1, 0, 0]
    rows = torch.arange(7)
    shares = [dispatch.rank_rows(rows, r, 2).tolist() for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(7)) and len(shares[0]) - len(shares[1]) == 1
    seqs = _rows([1, 2, 3, 4, 5, 6, 7])
    parts = dispatch.micro_batches(seqs, rows, 2, 3, None)  # strided shares, 3 rows a micro-batch
    assert [len(p) for p in parts] == [2, 1] and sorted(torch.cat([*parts[0], *parts[1]]).tolist()) == list(range(7))


def _rows(lengths: list[int], prompt: int = 2):
    from flowrl.contract.data import Sequences

    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    n = len(lengths)
    return Sequences(
        prompt_ids=torch.ones(n, prompt, dtype=torch.long),
        prompt_mask=torch.ones(n, prompt, dtype=torch.long),
        response_ids=torch.ones(n, width, dtype=torch.long),
        response_mask=mask,
        prompt_index=torch.arange(n),
        texts=("",) * n,
    )


def test_a_token_budget_fills_micro_batches_and_balances_ranks():
    """A long tail: seven short rows and one long one. Rows split micro-batches by their padded size
    (rows x (prompt + longest response) <= budget), a row longer than the budget is alone, and two
    ranks get equal tokens, not equal rows."""
    lengths = [4, 4, 4, 4, 4, 4, 4, 30]
    seqs = _rows(lengths)
    rows = torch.arange(len(lengths))
    (one,) = dispatch.micro_batches(seqs, rows, 1, 100, 24)  # 4 short rows (6 tokens each) fill 24
    assert [sorted(p.tolist()) for p in one] == [[0, 1, 2, 3], [4, 5, 6], [7]]
    for part in one:
        padded, real = dispatch.padding(seqs.select(part))
        assert padded <= 24 or len(part) == 1
    two = dispatch.micro_batches(seqs, rows, 2, 100, 24)
    tokens = [sum(2 + lengths[i] for p in share for i in p.tolist()) for share in two]
    assert tokens == [38, 36]  # (strided shares of rows: 50 and 24)
    assert sorted(i for share in two for p in share for i in p.tolist()) == list(range(8))
    assert dispatch.micro_batches(seqs, rows, 1, 2, 10_000)[0][0].numel() == 2  # the row cap still holds


def test_concat_sequences_repads_and_shifts_prompt_index():
    def seqs(prompt_width, response_width, rows, index):
        return Sequences(
            prompt_ids=torch.ones(rows, prompt_width, dtype=torch.long),
            prompt_mask=torch.ones(rows, prompt_width, dtype=torch.long),
            response_ids=torch.full((rows, response_width), 2, dtype=torch.long),
            response_mask=torch.ones(rows, response_width),
            prompt_index=torch.tensor(index),
            texts=("x",) * rows,
            version=3,
        )

    out = Sequences.concat([seqs(2, 3, 2, [0, 0]), seqs(4, 1, 1, [0])], pad_id=0, index_offsets=[0, 1])
    assert out.prompt_ids.shape == (3, 4) and out.response_ids.shape == (3, 3)
    assert out.prompt_mask[0].tolist() == [0, 0, 1, 1]  # prompts stay right-aligned
    assert out.response_mask[2].tolist() == [1.0, 0.0, 0.0]
    assert out.prompt_index.tolist() == [0, 0, 1] and out.version == 3
    assert dispatch.mean_stats([{"loss": 1.0}, {"loss": 3.0, "kl": 2.0}]) == {"loss": 2.0, "kl": 2.0}
