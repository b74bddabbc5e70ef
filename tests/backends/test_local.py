"""The local torch backend: HF loading, sampling with log-probs, forward, train steps."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl import api
from flowrl.backends.local.generation import sample, top_p_filter
from flowrl.backends.local.models import build_causal_lm, load_tokenizer, model_config
from flowrl.contract.data import Prompt, Rollout
from flowrl.contract.protocols import GenerationEngine, TrainingEngine, TrainStep
from flowrl.errors import ConfigError
from flowrl.plugins.manager import registry
from flowrl.runtime.batch import pack_left, select_rows
from flowrl.runtime.executor import PlanExecutor
from flowrl.specs import AlgoConfig, TinyModelConfig

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "task=copy"]


def build(graph: str = "ppo", extra: list[str] = ()):
    g, plan = api.plan(graph, overrides=[*SMALL, *extra], emit=lambda s: None)
    trainers, _ = PlanExecutor(registry()).engines(g, plan)
    return g, plan, trainers


def gen(engine, prompts, n, seed=0, **kw):
    r = engine.generate(
        prompts, n=n, greedy=kw.pop("greedy", False), generator=torch.Generator().manual_seed(seed), **kw
    )
    return r.sequences, r.logprobs


@pytest.fixture(scope="module")
def ppo():
    return build("ppo")


def test_hf_directory_round_trip(tmp_path):
    tok = load_tokenizer(None)
    cfg = model_config(None, TinyModelConfig(), tok)
    model = build_causal_lm(None, cfg, seed=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = build_causal_lm(
        str(tmp_path), model_config(str(tmp_path), TinyModelConfig(), load_tokenizer(str(tmp_path))), seed=99
    )
    ids = torch.tensor([[1, 5, 6, 7]])
    assert torch.allclose(model(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-6)


def test_a_missing_model_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        load_tokenizer(str(tmp_path / "empty"))


def test_generation_logprobs_match_training_forward(ppo):
    g, plan, engines = ppo
    actor = engines["actor"]
    prompts = [Prompt(text="ab>", answer="ab"), Prompt(text="dcba>", answer="dcba")]
    seqs, gen_logprobs = gen(actor, prompts, n=3)
    fwd = actor.forward(seqs, "logprobs", 0)
    mask = seqs.response_mask.bool()
    diff = (gen_logprobs - fwd)[mask].abs().max().item()
    print(f"max |generation logprob - training-forward logprob| = {diff:.2e}")
    assert diff < 1e-4
    assert seqs.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert len(seqs.texts) == 6


def test_sampling_stops_at_eos_and_masks_after():
    torch.manual_seed(0)
    tok = load_tokenizer(None)
    model = build_causal_lm(None, model_config(None, TinyModelConfig(), tok), seed=0)
    with torch.no_grad():  # make EOS overwhelmingly likely after the first token
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
        model.lm_head.bias[tok.eos_token_id] = 50.0
    enc = tok(["ab>", "c>"], return_tensors="pt", padding=True)
    tokens, logprobs, mask = sample(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        max_new_tokens=5,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
    )
    assert tokens.shape[1] == 1  # every row stopped at once
    assert (tokens[:, 0] == tok.eos_token_id).all() and mask.sum() == 2
    tokens, _, mask = sample(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        max_new_tokens=5,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        ignore_eos=True,
    )
    assert tokens.shape[1] == 5 and mask.sum() == 10


def test_greedy_is_deterministic_and_top_p_keeps_the_head():
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]])
    kept = top_p_filter(logits, 0.7)  # p = .66, .24, .03, .01 -> keep the first two
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    tok = load_tokenizer(None)
    model = build_causal_lm(None, model_config(None, TinyModelConfig(), tok), seed=0)
    enc = tok(["ab>"] * 2, return_tensors="pt", padding=True)
    a = sample(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=4, eos_id=2, pad_id=0, greedy=True)[0]
    b = sample(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=4, eos_id=2, pad_id=0, greedy=True)[0]
    assert torch.equal(a, b) and torch.equal(a[0], a[1])


def test_critic_values_and_reference_copy(ppo):
    g, plan, engines = ppo
    seqs, _ = gen(engines["actor"], [Prompt(text="ab>", answer="ab")], n=2)
    values = engines["critic"].forward(seqs, "values", 0)
    assert values.shape == seqs.response_mask.shape
    ref = engines["ref"].forward(seqs, "logprobs", 0)
    act = engines["actor"].forward(seqs, "logprobs", 1)
    assert torch.allclose(ref, act)  # the reference starts as a copy of the actor
    assert not any(p.requires_grad for p in engines["ref"].module.parameters())


def _step(engine, micro: int) -> TrainStep:
    return TrainStep(
        node="train_actor",
        sequences_key="responses",
        output="logprobs",
        micro_batch=micro,
        epochs=1,
        mini_batches=1,
        algo=AlgoConfig(),
        generator=torch.Generator().manual_seed(0),
    )


def _grad_step(engine, batch, micro: int):
    engine = copy.deepcopy(engine)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.train(registry().get("losses", "ppo"), batch, _step(engine, micro))
    return {k: engine.module.state_dict()[k] - before[k] for k in before}


def test_micro_batch_accumulation_equals_the_full_batch(ppo):
    g, plan, engines = ppo
    actor = engines["actor"]
    prompts = [Prompt(text=t, answer=t[:-1]) for t in ("ab>", "bcd>", "a>", "dd>")]
    seqs, logprobs = gen(actor, prompts, n=2, seed=3)
    adv = torch.linspace(-1, 1, len(seqs))[:, None] * seqs.response_mask
    batch = {"responses": seqs, "old_logprobs": logprobs, "advantages": adv}
    full = _grad_step(actor, batch, micro=len(seqs))
    micro = _grad_step(actor, batch, micro=3)
    worst = max((full[k] - micro[k]).abs().max().item() for k in full)
    # fp32 summation order only: 1.9e-6 and 8.9e-6 seen on two sampled batches, 2.01e-5 on another CPU;
    # AdamW's first step moves a weight by up to lr = 2e-3, so 1e-4 is 5 % of a step
    assert worst < 1e-4
    assert max(v.abs().max().item() for v in full.values()) > 0  # the step changed the weights


def test_select_rows_slices_sequence_level_values_only(ppo):
    g, plan, engines = ppo
    seqs, logprobs = gen(engines["actor"], [Prompt(text="ab>", answer="ab")], n=4)
    out = select_rows(
        {"responses": seqs, "lp": logprobs, "prompts": ["p"], "scalar": torch.tensor(1.0)}, torch.tensor([2, 0]), 4
    )
    assert len(out["responses"]) == 2 and out["lp"].shape[0] == 2
    assert out["prompts"] == ["p"] and out["scalar"].item() == 1.0
    assert torch.equal(out["lp"][0], logprobs[2])


# ---------------------------------------------------------------------------- the engine protocol


def test_local_engines_implement_the_runtime_protocols(ppo):
    g, plan, engines = ppo
    for engine in engines.values():
        assert isinstance(engine, TrainingEngine)
    assert isinstance(engines["actor"], GenerationEngine) and engines["actor"].resumable


def test_pack_left_moves_real_tokens_right_in_order():
    ids = torch.tensor([[0, 7, 8, 9, 0], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    packed, m = pack_left(ids, mask)
    assert packed.tolist()[0][-3:] == [7, 8, 9] and m.tolist()[0] == [0, 0, 1, 1, 1]
    assert packed.tolist()[1] == [5, 6, 7, 8, 9]


def test_greedy_resume_continues_exactly_where_generation_stopped(ppo):
    """Stopping after 2 tokens and resuming gives the tokens (and log-probs) of one long call."""
    g, plan, engines = ppo
    actor = engines["actor"]
    prompts = [Prompt(text=t, answer=t[:-1]) for t in ("abc>", "d>", "bb>")]
    full = actor.generate(prompts, n=1, greedy=True, generator=torch.Generator())
    part = actor.generate(prompts, n=1, greedy=True, generator=torch.Generator(), max_new_tokens=2)
    assert part.sequences.response_ids.shape[1] <= 2
    long_rows = full.sequences.response_lengths > 2
    assert (~part.finished[long_rows]).all()  # cut short: they may resume
    done = actor.resume(part, generator=torch.Generator())
    assert done.finished.all()
    assert done.sequences.texts == full.sequences.texts
    assert torch.equal(done.sequences.response_mask, full.sequences.response_mask)
    assert torch.allclose(done.logprobs, full.logprobs, atol=1e-5)
    assert torch.equal(done.sequences.prompt_ids, full.sequences.prompt_ids)


def test_resume_leaves_finished_rows_alone_and_keeps_grouping(ppo):
    g, plan, engines = ppo
    actor = engines["actor"]
    part = actor.generate(
        [Prompt(text="ab>", answer="ab"), Prompt(text="c>", answer="c")],
        n=2,
        greedy=False,
        generator=torch.Generator().manual_seed(1),
        max_new_tokens=1,
    )
    assert isinstance(part, Rollout) and part.sequences.prompt_index.tolist() == [0, 0, 1, 1]
    before = part.sequences.response_ids[part.finished].clone()
    done = actor.resume(part, generator=torch.Generator().manual_seed(2))
    assert torch.equal(done.sequences.response_ids[part.finished][:, : before.shape[1]], before)
    assert done.sequences.prompt_index.tolist() == [0, 0, 1, 1]
    assert (done.sequences.response_lengths >= part.sequences.response_lengths).all()


def test_weights_export_import_round_trip_and_saved_state(ppo, tmp_path):
    g, plan, engines = ppo
    actor, ref = engines["actor"], engines["ref"]
    seqs, _ = gen(actor, [Prompt(text="ab>", answer="ab")], n=2)
    actor.save_state(tmp_path / "actor")
    with torch.no_grad():
        for p in actor.module.parameters():
            p.add_(0.01)
    assert not torch.allclose(actor.forward(seqs, "logprobs", 0), ref.forward(seqs, "logprobs", 0))
    assert actor.load_state(tmp_path / "actor") == actor.version
    assert torch.equal(actor.forward(seqs, "logprobs", 0), ref.forward(seqs, "logprobs", 0))
    ref.import_weights(actor.export_weights())
    assert torch.equal(ref.forward(seqs, "logprobs", 0), actor.forward(seqs, "logprobs", 0))


def test_draw_samples_each_row_from_its_distribution_and_never_a_token_without_mass():
    from flowrl.backends.local.generation import draw

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.1, 0.2, 0.3, 0.4, 0.0]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(probs)
    n = 20000
    for _ in range(n // 100):
        toks = draw(probs.repeat(100, 1), g).view(100, 3)
        for row in range(3):
            counts[row] += torch.bincount(toks[:, row], minlength=5).float()
    freq = counts / n
    assert torch.all(freq[probs == 0] == 0)  # never a token without mass
    assert torch.allclose(freq, probs, atol=0.015)  # 3 sigma of a 20000-draw frequency is < 0.011
    # rounding in the cumulative sum cannot carry a draw past the last token with mass
    edge = torch.tensor([[0.3, 0.7 - 1e-7, 0.0, 0.0]])
    assert all(int(draw(edge, g)) in (0, 1) for _ in range(2000))


def test_draw_refuses_probabilities_that_are_not_finite():
    from flowrl.backends.local.generation import draw

    probs = torch.tensor([[0.5, 0.5], [float("nan"), 0.5]])
    with pytest.raises(RuntimeError, match="not finite"):
        draw(probs, torch.Generator().manual_seed(0))
