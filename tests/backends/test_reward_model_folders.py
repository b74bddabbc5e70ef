"""HF reward models and a folder per graph model.

A reward/cost model (or a critic) saved as a sequence-classification checkpoint loads with its
trained ``score`` head; flowrl's own save of a scalar-head model loads back with the same head; a
reward model whose tokenizer is not the actor's re-tokenises the decoded text; and a PPO run with
``--model actor=A,reward=RM`` runs. Every model here is a tiny one built on the fly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowrl.backends.local.factories import training_engine
from flowrl.backends.local.models import (
    ValueModel,
    build_model,
    load_tokenizer,
    model_config,
    same_tokenizer,
    save_hf,
    scalar_checkpoint,
)
from flowrl.cli import main
from flowrl.contract.data import Prompt
from flowrl.contract.protocols import EngineContext
from flowrl.contract.resolved import ModelRun
from flowrl.errors import BackendError
from flowrl.graph.ir import ModelDecl
from flowrl.specs import TinyModelConfig
from flowrl.tasks.tokenizer import CHARS, build_tokenizer

TINY = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
PROMPTS = [Prompt(text="abc>", answer="abc"), Prompt(text="dcba>", answer="dcba")]


def bpe_tokenizer():
    """A tokenizer unlike flowrl's character one: BPE merges over the toy tasks' text, its own
    special tokens at other ids, BOS prepended."""
    import transformers
    from tokenizers import Tokenizer, models, processors, trainers

    corpus = [f"{w}>{w}" for w in ("abc", "dcba", "hello", "copy", "bab", "cab")] * 20 + [CHARS]
    backend = Tokenizer(models.BPE(unk_token="[UNK]"))
    special = ["[UNK]", "[PAD]", "[BOS]", "[EOS]"]
    trainer = trainers.BpeTrainer(
        vocab_size=90, special_tokens=special, initial_alphabet=list(CHARS), show_progress=False
    )
    backend.train_from_iterator(corpus, trainer)
    bos = backend.token_to_id("[BOS]")
    backend.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", bos)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]"
    )


def classifier_folder(path: Path, tok, seed: int = 3) -> Path:
    """A tiny ``LlamaForSequenceClassification`` (num_labels=1) with a non-random score head, saved."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=TINY.hidden_size,
        intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():  # a head no fresh initialisation draws
        model.score.weight.copy_(torch.linspace(-1.0, 1.0, TINY.hidden_size)[None])
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def lm_folder(path: Path, seed: int = 0) -> Path:
    """A tiny causal LM with flowrl's character tokenizer, saved as an HF folder."""
    from flowrl.backends.local.models import build_causal_lm

    tok = load_tokenizer(None)
    save_hf(build_causal_lm(None, model_config(None, TINY, tok), seed), path)
    tok.save_pretrained(path)
    return path


def hf_score(path: Path, text: str | list[int]) -> float:
    """transformers' own forward of the classifier in ``path`` on ``text`` (tokenised by its own
    tokenizer) or on token ids."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"] if isinstance(text, str) else text
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def engine(name: str, role: str, checkpoint: Path | None, source=None):
    decl = ModelDecl(name=name, role=role, trainable=False, init_from=None if source is None else "actor")
    spec = ModelRun(model=name, checkpoint=None if checkpoint is None else str(checkpoint), tiny=TINY)
    return training_engine(EngineContext(decl=decl, spec=spec, device="cpu", source=source))


@pytest.fixture(scope="module")
def actor():
    return engine("actor", "actor", None)


@pytest.fixture(scope="module")
def rollout(actor):
    return actor.generate(PROMPTS, n=2, greedy=False, generator=torch.Generator().manual_seed(0), max_new_tokens=5)


def test_a_sequence_classification_folder_loads_with_its_score_head(tmp_path, actor, rollout):
    path = classifier_folder(tmp_path / "rm", build_tokenizer())
    assert scalar_checkpoint(str(path)) == "classifier"
    rm = engine("rm", "reward", path)
    assert isinstance(rm.module, ValueModel) and rm.text_tokenizer is None
    assert torch.equal(rm.module.head.weight, torch.linspace(-1.0, 1.0, TINY.hidden_size)[None])
    seqs = rollout.sequences
    scores = rm.forward(seqs, "scores", 0)
    for i in range(len(seqs)):  # the same tokens unpadded: prompt (with BOS) + the sampled response
        ids = seqs.prompt_ids[i][seqs.prompt_mask[i].bool()].tolist()
        ids += seqs.response_ids[i][: int(seqs.response_mask[i].sum())].tolist()
        assert scores[i].item() == pytest.approx(hf_score(path, ids), abs=1e-4)


def test_a_critic_initialises_from_a_classifier_its_value_head_from_score(tmp_path):
    path = classifier_folder(tmp_path / "rm", build_tokenizer())
    critic = build_model(str(path), model_config(str(path), TINY, load_tokenizer(str(path))), 0, True, "critic")
    assert torch.equal(critic.head.weight, torch.linspace(-1.0, 1.0, TINY.hidden_size)[None])
    assert torch.equal(critic.head.bias, torch.zeros(1))


def test_a_causal_lm_folder_gives_a_scalar_model_a_fresh_head_and_says_so(tmp_path, capsys):
    path = lm_folder(tmp_path / "lm")
    assert scalar_checkpoint(str(path)) == "lm"
    model = build_model(str(path), model_config(str(path), TINY, load_tokenizer(str(path))), 0, True, "rm")
    assert isinstance(model, ValueModel)
    err = capsys.readouterr().err
    assert "model 'rm'" in err and str(path) in err and "fresh" in err


def test_a_trained_scalar_head_round_trips_through_its_saved_checkpoint(tmp_path, rollout):
    critic = engine("critic", "critic", None)
    with torch.no_grad():  # as if trained: a head no initialisation gives
        critic.module.head.weight.mul_(-3.0)
        critic.module.head.bias.fill_(0.25)
    critic.save(tmp_path / "critic")
    assert scalar_checkpoint(str(tmp_path / "critic")) == "flowrl"
    again = engine("critic", "critic", tmp_path / "critic")
    for key, value in critic.module.state_dict().items():
        assert torch.equal(again.module.state_dict()[key], value), key
    seqs = rollout.sequences
    assert torch.equal(again.forward(seqs, "values", 0), critic.forward(seqs, "values", 0))


def test_a_reward_model_with_another_tokenizer_scores_the_retokenised_text(tmp_path, actor, rollout):
    bpe = bpe_tokenizer()
    assert not same_tokenizer(bpe, build_tokenizer()) and same_tokenizer(build_tokenizer(), build_tokenizer())
    path = classifier_folder(tmp_path / "rm", bpe)
    rm = engine("rm", "reward", path, source=actor)
    assert rm.text_tokenizer is actor.tokenizer
    seqs = rollout.sequences
    scores = rm.forward(seqs, "scores", 3)  # micro-batches of rows of mixed lengths
    for i in range(len(seqs)):
        prompt = PROMPTS[int(seqs.prompt_index[i])].text
        assert scores[i].item() == pytest.approx(hf_score(path, prompt + seqs.texts[i]), abs=1e-4)
    assert len(bpe(PROMPTS[0].text)["input_ids"]) != len(build_tokenizer()(PROMPTS[0].text)["input_ids"])


def test_a_critic_with_another_tokenizer_is_refused(tmp_path, actor):
    path = classifier_folder(tmp_path / "rm", bpe_tokenizer())
    with pytest.raises(BackendError, match="critic.*tokenizer"):
        engine("critic", "critic", path, source=actor)


def test_a_reward_model_fed_ids_beyond_its_vocabulary_names_the_cause(tmp_path, rollout):
    path = classifier_folder(tmp_path / "rm", bpe_tokenizer())
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rm = engine("rm", "reward", path)  # no source: it cannot know the actor's tokenizer
    # as if an actor with a larger vocabulary wrote the responses
    seqs = rollout.sequences.replaced(response=lambda t, fill: t if t.dtype != torch.long else t + vocab)
    with pytest.raises(BackendError, match="beyond its vocabulary"):
        rm.forward(seqs, "scores", 0)


@pytest.mark.slow
def test_a_ppo_run_with_a_reward_model_folder_of_its_own(tmp_path, capsys):
    actor_dir = lm_folder(tmp_path / "actor")
    rm_dir = classifier_folder(tmp_path / "rm", bpe_tokenizer())
    out = tmp_path / "runs"
    argv = ["run", "graphs/ppo_rm.py", "--model", f"actor={actor_dir},reward={rm_dir}", "--steps", "2", "--quiet"]
    argv += ["--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2", "--set", "task=copy"]
    argv += ["--set", "rollout.max_new_tokens=4", "--set", f"out={out}", "--set", "name=rm"]
    assert main(argv) == 0, capsys.readouterr().err
    plan = (out / "rm" / "plan.yaml").read_text()
    assert str(rm_dir.resolve()) in plan and str(actor_dir.resolve()) in plan
    rows = [json.loads(line) for line in (out / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [0, 1]
    # the checkpoint records each model folder's weight files; the run resumes from it
    state = json.loads(sorted((out / "rm" / "checkpoints").glob("step-*/state.json"))[-1].read_text())
    assert set(state["base"]) == {str(actor_dir.resolve()), str(rm_dir.resolve())}
    assert main(["run", "graphs/ppo_rm.py", "--resume", str(out / "rm"), "--steps", "3", "--quiet"]) == 0


@pytest.mark.parametrize("pack", [False, True])
def test_a_reward_model_whose_pad_token_is_its_end_token_scores_where_hf_pools(tmp_path, pack):
    from flowrl.contract.data import Completion
    from flowrl.runtime.offline import offline_sequences

    tok = build_tokenizer()
    tok.pad_token = tok.eos_token  # as flowrl sets it for a tokenizer without one
    path = classifier_folder(tmp_path / "rm", tok)
    decl = ModelDecl(name="rm", role="reward", trainable=False)
    rm = training_engine(EngineContext(decl=decl, spec=ModelRun(model="rm", checkpoint=str(path), pack=pack),
                                       device="cpu"))  # fmt: skip
    answers = ["ab", "dcba", "c"]
    prompts = [Prompt(text=f"{a}>", answer=a, completions=(Completion(pieces=(a,), trained=(True,), eos=True),))
               for a in answers]  # fmt: skip
    seqs, _ = offline_sequences(prompts, None, rm.tokenizer, rm.tokenizer.pad_token_id)
    assert all(int(seqs.response_ids[i, len(a)]) == tok.eos_token_id for i, a in enumerate(answers))  # each ends so
    scores = rm.forward(seqs, "scores", 0)
    for i, a in enumerate(answers):  # HF reads the last token that is not its pad token: the one before the end
        ids = tok(f"{a}>{a}")["input_ids"] + [tok.eos_token_id]
        assert scores[i].item() == pytest.approx(hf_score(path, ids), abs=1e-4)
        assert scores[i].item() == pytest.approx(hf_score(path, ids[:-1]), abs=1e-4)
