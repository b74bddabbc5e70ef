"""Cutting a model into pipeline stages (flowrl/backends/local/parallelize/pipeline.py), in one process:
layers split contiguously and as evenly as they go, a rank keeps its layers under their global names
(the embeddings on the first, norm and head on the last), and the stages of every rank, chained,
compute what the whole model computes (log-probs, values, scores)."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.backends.local.parallelize import pipeline
from flowrl.backends.local.parallelize.tensor import token_logprobs
from flowrl.errors import BackendError
from flowrl.runtime.batch import position_ids


def test_layers_split_contiguously_and_evenly():
    assert [list(r) for r in pipeline.layer_ranges(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in pipeline.layer_ranges(4, 4)] == [[0], [1], [2], [3]]


def test_interleaved_ranks_hold_looped_stages():
    assert pipeline.stages_of(0, 2, 2) == [0, 2] and pipeline.stages_of(1, 2, 2) == [1, 3]


def test_a_rank_keeps_its_layers_under_their_global_names(tiny):
    whole = tiny()
    names = set(whole.state_dict())
    first, last = copy.deepcopy(whole), copy.deepcopy(whole)
    pipeline.split(first, 0, 2, 1)
    pipeline.split(last, 1, 2, 1)
    a, b = set(first.state_dict()), set(last.state_dict())
    assert a | b == names and not a & b
    assert "model.embed_tokens.weight" in a and "model.layers.0.self_attn.q_proj.weight" in a
    assert {"lm_head.weight", "model.norm.weight", "model.layers.1.mlp.up_proj.weight"} <= b


def _rows():
    torch.manual_seed(0)
    ids = torch.randint(3, 40, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    return ids, mask, position_ids(mask)


@pytest.mark.parametrize(("pp", "virtual"), [(2, 1), (2, 2)])
def test_chained_stages_compute_the_whole_models_log_probs(tiny, pp, virtual):
    whole = tiny()
    if virtual > 1:  # 4 layers for 4 stages: the tiny model's 2 layers, twice
        whole = _four_layers(whole)
    ids, mask, pos = _rows()
    tokens = ids[:, 5:]
    with torch.no_grad():
        logits = whole(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, 4:-1]
        want = token_logprobs(logits, tokens, 1.0)
        stages = sorted(
            (s for p in range(pp) for s in pipeline.split(copy.deepcopy(whole), p, pp, virtual)), key=lambda s: s.index
        )
        x = ids
        for stage in stages:
            stage.configure("logprobs", 4, 1.0)
            x = stage(x, mask, pos, tokens, torch.zeros(3, dtype=torch.long))
    assert torch.allclose(x, want, atol=1e-6)


def test_chained_stages_compute_a_scalar_heads_values_and_scores(tiny):
    whole = tiny(scalar_head=True)
    ids, mask, pos = _rows()
    last = torch.tensor([8, 7, 6])
    with torch.no_grad():
        values = whole(ids, mask, pos)
        outs = {}
        for output in ("values", "scores"):
            x = ids
            for stage in [pipeline.split(copy.deepcopy(whole), p, 2, 1)[0] for p in range(2)]:
                stage.configure(output, 4, 1.0)
                x = stage(x, mask, pos, ids[:, 5:], last)
            outs[output] = x
    assert torch.allclose(outs["values"], values[:, 4:-1], atol=1e-6)
    assert torch.allclose(outs["scores"], values.gather(1, last[:, None]).squeeze(1), atol=1e-6)


def test_a_tied_head_splits_into_an_equal_copy_on_the_last_stage(tiny):
    assert pipeline.tied_names(tiny()) is None
    module = tiny()
    module.lm_head.weight = module.model.embed_tokens.weight  # as HF's tie_word_embeddings ties them
    pipeline.check_split(module, 2, 1, "1f1b", "actor")  # no refusal
    assert pipeline.tied_names(module) == ("model.embed_tokens.weight", "lm_head.weight")
    first, last = copy.deepcopy(module), copy.deepcopy(module)
    pipeline.split(first, 0, 2, 1)
    pipeline.split(last, 1, 2, 1)
    assert first.lm_head is None and last.model.embed_tokens is None
    copied = last.lm_head.weight
    assert isinstance(copied, torch.nn.Parameter) and copied.requires_grad
    assert torch.equal(copied, module.model.embed_tokens.weight)
    assert copied.data_ptr() != module.model.embed_tokens.weight.data_ptr()


def test_virtual_stages_need_the_interleaved_schedule(tiny):
    with pytest.raises(BackendError, match="2 virtual stages per rank need the 'interleaved' schedule, not 'gpipe'"):
        pipeline.check_split(tiny(), 2, 2, "gpipe", "actor")


def _four_layers(module):
    from torch import nn

    layers = module.model.layers
    module.model.layers = nn.ModuleList([*layers, *copy.deepcopy(layers)])
    module.config.num_hidden_layers = 4
    return module


def test_a_call_with_fewer_micro_batches_than_the_schedule_needs_computes_smaller_ones():
    from flowrl.backends.local.staged import slots, split_to

    parts = split_to([torch.arange(5)], 2)  # 1F1B over 2 stages: one micro-batch of 5 rows becomes 3 + 2
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    rows, target = slots(parts, 2, 0)  # one row count: the second micro-batch repeats its last row, counted -1
    assert rows.tolist() == [0, 1, 2, 3, 4, 4] and target.tolist() == [0, 1, 2, 3, 4, -1]
    assert len(split_to([torch.arange(1)], 2)) == 1  # one row cannot be halved: the schedule's other is empty
