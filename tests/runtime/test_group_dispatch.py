"""How a worker group's calls reach its ranks: the dispatch mode declared on each worker method, rows
cut by the data shards the ranks declare (no tensor-parallel stride in the runtime), and the per-rank
slice sync chosen by the engines' declared shard layouts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.contract.protocols import DataRank, ShardedGenerationEngine, ShardedTrainingEngine
from flowrl.errors import BackendError
from flowrl.runtime import dispatch
from flowrl.runtime.groups import GenerationGroup, TrainingGroup
from flowrl.runtime.worker import Worker


class _Ranks:
    """A transport over ranks that declare data shards of ``split`` consecutive ranks each; it records
    every call and answers a rank with (rank, args)."""

    def __init__(self, split: int) -> None:
        self.split = split
        self.calls: list[tuple[list[int], str, list[tuple]]] = []

    def call(self, ranks, method, args, tag):
        if method == "data_rank":
            return [DataRank(index=r // self.split, count=len(ranks) // self.split) for r in ranks]
        self.calls.append((list(ranks), method, list(args)))
        return [(r, a) for r, a in zip(ranks, args)]


def test_every_method_a_group_calls_declares_how_it_is_dispatched():
    called = ["forward", "train", "generate", "resume", "load_weights", "export_weights", "import_weights"]
    called += ["save_state", "load_state", "save", "sync", "data_rank"]
    modes = {m: dispatch.mode_of(Worker, m) for m in called}
    assert modes["forward"] == dispatch.ROWS_EVEN and modes["generate"] == dispatch.ROWS
    assert modes["train"] == dispatch.ALL_MEAN and modes["export_weights"] == dispatch.ALL_FIRST


def test_a_method_without_a_dispatch_mode_is_refused_by_name():
    with pytest.raises(TypeError, match=r"Worker.setup declares no dispatch mode"):
        dispatch.mode_of(Worker, "setup")


def test_ranks_disagreeing_on_the_number_of_shards_are_refused():
    with pytest.raises(BackendError, match=r"rank 1 of group \[0, 1\] says it computes data shard 0 of 1"):
        dispatch.shard_ranks((0, 1), [DataRank(index=0, count=2), DataRank(index=0, count=1)])


def test_a_mode_that_splits_rows_must_collect_rows():
    with pytest.raises(ValueError, match="cannot collect"):
        dispatch.Dispatch(split="rows", collect="first")


def test_generation_replicas_are_the_data_shards_the_ranks_declare(monkeypatch):
    from flowrl.contract.data import Rollout

    seen = []
    monkeypatch.setattr(Rollout, "concat", staticmethod(lambda parts, pad, offsets: seen.append((parts, offsets))))
    t = _Ranks(split=2)
    group = GenerationGroup("actor", (0, 1, 2, 3), t, pad_id=0)
    assert group.replicas == [(0, 1), (2, 3)]
    group.generate(list("abc"), n=2, greedy=False, generator=torch.Generator().manual_seed(0))
    ranks, method, args = t.calls[-1]
    assert (ranks, method) == ([0, 1, 2, 3], "generate")
    assert args[0] == args[1] and args[2] == args[3]  # a replica's ranks sample alike (one seed)
    assert args[0][1] == ["a", "b"] and args[2][1] == ["c"]
    assert args[0][4] != args[2][4]  # the replicas draw differently
    parts, offsets = seen[-1]
    assert [p[0] for p in parts] == [0, 2] and offsets == [0, 2]  # each replica's first rank answers


def test_fewer_prompts_than_replicas_call_only_the_replicas_used(monkeypatch):
    from flowrl.contract.data import Rollout

    seen = []
    monkeypatch.setattr(Rollout, "concat", staticmethod(lambda parts, pad, offsets: seen.append((parts, offsets))))
    t = _Ranks(split=2)
    group = GenerationGroup("actor", (0, 1, 2, 3), t, pad_id=0)
    group.generate(["only"], n=4, greedy=True, generator=torch.Generator().manual_seed(0))
    ranks, _, args = t.calls[-1]
    assert ranks == [0, 1] and len(args) == 2 and args[0] == args[1]
    assert [p[0] for p in seen[-1][0]] == [0]
    group.generate([], n=4, greedy=True, generator=torch.Generator().manual_seed(0))  # none: one replica, no rows
    assert t.calls[-1][0] == [0, 1]


def test_a_forward_pads_every_data_shard_to_the_same_rows_and_keeps_each_shards_first_answer():
    from flowrl.contract.data import Sequences

    class _Scores(_Ranks):
        def call(self, ranks, method, args, tag):
            if method == "data_rank":
                return super().call(ranks, method, args, tag)
            self.calls.append((list(ranks), method, list(args)))
            return [a[1].prompt_ids[:, 0].float() * 10 + r for r, a in zip(ranks, args)]

    t = _Scores(split=2)
    decl = SimpleNamespace(name="critic")
    group = TrainingGroup(decl, (0, 1, 2, 3), t, None, None)
    ids = torch.arange(3)[:, None]
    seqs = Sequences(
        prompt_ids=ids,
        prompt_mask=torch.ones(3, 1, dtype=torch.long),
        response_ids=torch.ones(3, 1, dtype=torch.long),
        response_mask=torch.ones(3, 1),
        prompt_index=torch.arange(3),
        texts=("a", "b", "c"),
    )
    out = group.forward(seqs, "scores", 4)
    ranks, method, args = t.calls[-1]
    assert ranks == [0, 1, 2, 3] and method == "forward"
    assert [len(a[1]) for a in args] == [2, 2, 2, 2]  # the short shard repeats its last row
    assert out.tolist() == [0.0, 10.0, 22.0]  # rows 0, 1 from rank 0; row 2 from rank 2, its padding dropped


def test_ranks_declaring_shards_that_do_not_cover_the_rows_are_refused():
    with pytest.raises(BackendError, match=r"no rank of group \[0, 1\] computes data shard\(s\) \[1\] of 2"):
        dispatch.shard_ranks((0, 1), [DataRank(index=0, count=2), DataRank(index=0, count=2)])


# ------------------------------------------------------------ the worker's per-rank slice sync


class _Trainer:
    """A training engine of the sharded protocol, counting whole and per-rank exports."""

    decl, tokenizer, hf_config, version = SimpleNamespace(name="actor"), None, None, 0

    def __init__(self, layout: str | None) -> None:
        self.layout, self.exported, self.sliced = layout, 0, 0

    def forward(self, seqs, output, micro_batch): ...
    def train(self, loss, batch, step): ...
    def import_weights(self, weights): ...
    def save_state(self, path: Path): ...
    def load_state(self, path: Path): ...
    def save(self, path: Path): ...

    def data_rank(self):
        return DataRank(index=0, count=1)

    def shard_layout(self):
        return self.layout

    def export_weights(self):
        self.exported += 1
        return {"w": torch.zeros(4, 4)}

    def export_local_shards(self):
        self.sliced += 1
        return {"w": torch.zeros(2, 4)}


class _Replica:
    version, resumable = 0, False

    def __init__(self) -> None:
        self.loaded = []

    def generate(self, prompts, *, n, greedy, generator, max_new_tokens=None, temperature=None): ...
    def resume(self, rollout, *, generator, max_new_tokens=None): ...

    def shard_layout(self):
        return "torch-tp2"

    def load_local_shards(self, shards, version):
        self.loaded.append(("shards", version, {k: tuple(v.shape) for k, v in shards.items()}))

    def load_weights(self, weights, version):
        self.loaded.append(("whole", version))


def _worker(trainer: _Trainer) -> Worker:
    assert isinstance(trainer, ShardedTrainingEngine) and isinstance(_Replica(), ShardedGenerationEngine)
    w = Worker(0, 2)
    place = SimpleNamespace(model="actor", group="all", generation_group="all")
    w.schedule = SimpleNamespace(ranks_of=lambda m: (0, 1), placement=lambda m: place)
    w.trainers = {"actor": trainer}
    w.generators = {"actor": _Replica()}
    return w


def test_engines_declaring_the_same_shard_layout_sync_each_ranks_own_slices_never_the_whole_model():
    w = _worker(_Trainer("torch-tp2"))
    stats = w.sync("actor", "reshard", 3)
    assert w.generators["actor"].loaded == [("shards", 3, {"w": (2, 4)})]
    assert stats["bytes"] == 2 * 4 * 4  # this rank's slice, not the whole model
    assert (w.trainers["actor"].sliced, w.trainers["actor"].exported) == (1, 0)


@pytest.mark.parametrize("layout", [None, "torch-tp4"])
def test_a_trainer_cut_otherwise_syncs_whole_weights(layout):
    w = _worker(_Trainer(layout))
    w.sync("actor", "reshard", 3)
    assert w.generators["actor"].loaded == [("whole", 3)]
    assert w.trainers["actor"].sliced == 0
