"""Evaluation during a run: a fixed set of held-out prompts, answered greedily and ``eval.samples``
times at ``eval.temperature``, scored by the task.

The set is data.val (at most ``eval.max_prompts`` of its rows); without it, ``eval.prompts`` of a
dataset's training rows (a seeded choice, each row at most once) or, for a task that draws its
prompts, ``eval.prompts`` prompts drawn with their own seeded RNG (never the training stream's).
It runs once before training and after every ``eval.every`` steps, at a pipeline barrier (nothing
else runs), with the weights the generation engine holds then and a random stream of its own, so a
run with evaluation trains exactly like one without.

Metrics (``eval/...`` in metrics.jsonl, the trackers and reward.png; a response is correct when
the task scores it 1.0):

- ``eval/greedy``: the fraction of prompts whose greedy response is correct;
- ``eval/mean@K``: the mean score of the K sampled responses; ``eval/pass@1`` and ``eval/pass@K``:
  the unbiased pass@k estimate (Chen et al., 2021) from the K samples;
- ``eval/maj@K``: the fraction of prompts whose most frequent final answer (majority vote over the
  K samples' answers as the task's verifier reads them) is correct;
- with a ``data.source_key`` column, each of them per source as ``eval/SOURCE/...``.

A graph that generates nothing (its responses come from the data: a source node) is evaluated by
its held-out loss (`LossEvaluator`): ``eval/loss``, the mean negative log-likelihood per trained
response token of the evaluation set's given responses under the trained model, and ``eval/tokens``.
One that reads preference pairs (a source with ``rows="pairs"``) by its held-out preferences
(`PreferenceEvaluator`): ``eval/preference_accuracy``, the fraction of held-out pairs whose chosen
response the trained model rewards above the rejected one, ``eval/margin`` (the mean difference),
``eval/reward_chosen``, ``eval/reward_rejected`` and ``eval/pairs``. The reward is DPO's implicit one,
beta * (log pi - log ref) summed over the response's trained tokens, with the reference model the
graph scores the pairs with (a forward node of log-probs on another model); without one, beta times
the mean log-prob per trained token (SimPO's reward). beta: the train node's ``beta`` option (1 without).
A reward model (a scalar head trained on the pairs: Bradley-Terry) rewards each response with its score.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flowrl.contract.data import Prompt
from flowrl.specs import RunConfig


def eval_prompts(cfg: RunConfig, task: Any) -> list[Prompt]:
    """The run's evaluation set: data.val (capped at eval.max_prompts) or prompts the task draws."""
    val = getattr(task, "val", None)
    if val:
        return list(val[: cfg.eval.max_prompts] if cfg.eval.max_prompts else val)
    rng = random.Random(f"flowrl-eval:{cfg.seed}")
    rows = getattr(task, "train", None)
    if isinstance(rows, list) and rows:  # a dataset without data.val: its rows, each at most once
        return rng.sample(rows, min(cfg.eval.prompts, len(rows)))
    return task.prompts(rng, cfg.eval.prompts)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``correct`` are correct."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def final_answer(task: Any, response: str) -> str:
    """What a majority vote counts: the final answer the task's verifier reads from ``response``."""
    from flowrl.tasks.verifiers import vote_key

    return vote_key(getattr(task, "verifier", None), response)


@dataclass
class Scored:
    """One prompt's evaluation: its greedy response and the K samples, with scores."""

    prompt: Prompt
    greedy: tuple[str, float] | None
    samples: list[tuple[str, float]]


def summarize(task: Any, rows: Sequence[Scored], k: int, source_key: str) -> dict[str, float]:
    """``eval/...`` metrics over ``rows``, overall and per source (when the rows have one)."""
    groups: dict[str, list[Scored]] = {"": list(rows)}
    for row in rows:
        source = row.prompt.meta.get(source_key)
        if isinstance(source, (str, int)) and str(source):
            groups.setdefault(f"{source}/", []).append(row)
    if len(groups) == 2:  # one source: the overall numbers say it all
        groups = {"": list(rows)}
    out: dict[str, float] = {}
    for prefix, group in groups.items():
        name = f"eval/{prefix}"
        if any(r.greedy is not None for r in group):
            out[f"{name}greedy"] = _mean([float(r.greedy[1] == 1.0) for r in group if r.greedy is not None])
        if k:
            out[f"{name}mean@{k}"] = _mean([s for r in group for _, s in r.samples])
            out[f"{name}pass@1"] = _mean([pass_at_k(k, _correct(r), 1) for r in group])
            if k > 1:
                out[f"{name}pass@{k}"] = _mean([pass_at_k(k, _correct(r), k) for r in group])
                out[f"{name}maj@{k}"] = _mean([_majority(task, r) for r in group])
        out[f"{name}prompts"] = float(len(group))
    return out


def _correct(row: Scored) -> int:
    return sum(1 for _, s in row.samples if s == 1.0)


def _majority(task: Any, row: Scored) -> float:
    """1.0 when the most frequent final answer among the samples is a correct one (ties: the first seen)."""
    votes: Counter[str] = Counter()
    score: dict[str, float] = {}
    for text, s in row.samples:
        answer = final_answer(task, text)
        votes[answer] += 1
        score.setdefault(answer, s)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a for a in votes if votes[a] == top)
    return float(score[winner] == 1.0)


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 6) if values else 0.0


class Evaluator:
    """Evaluates the policy a generation group samples with on the run's evaluation set."""

    def __init__(self, cfg: RunConfig, task: Any, generator: Any, budget: int | None) -> None:
        self.cfg, self.task, self.generator, self.budget = cfg, task, generator, budget
        self.prompts = eval_prompts(cfg, task)

    def due(self, step: int) -> bool:
        """Whether an evaluation follows step ``step`` (0-based)."""
        every = self.cfg.eval.every
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.cfg.steps)

    def run(self, updates: int) -> tuple[dict[str, Any], list[Scored]]:
        """The metrics record after ``updates`` training steps (0: before training) and the scored rows."""
        ev = self.cfg.eval
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + updates + 17) % 2**62)
        greedy = self._answers(1, True, g, None) if ev.greedy else None
        k = ev.samples
        temperature = None if ev.temperature == self.cfg.rollout.temperature else ev.temperature
        sampled = self._answers(k, False, g, temperature) if k else []
        rows = [
            Scored(
                prompt=p,
                greedy=greedy[i][0] if greedy is not None else None,
                samples=sampled[i] if sampled else [],
            )
            for i, p in enumerate(self.prompts)
        ]
        record: dict[str, Any] = {"step": updates, "kind": "eval", "version": self.generator.version}
        record.update(summarize(self.task, rows, k, self.cfg.data.source_key))
        return record, rows

    def _answers(
        self, n: int, greedy: bool, generator: torch.Generator, temperature: float | None
    ) -> list[list[tuple[str, float]]]:
        """Per prompt, ``n`` (response, score) pairs, generated in chunks of at most a training step's
        rows (prompts_per_step x samples_per_prompt: what the plan sized generation for)."""
        out: list[list[tuple[str, float]]] = [[] for _ in self.prompts]
        rows = self.cfg.rollout.prompts_per_step * self.cfg.rollout.samples_per_prompt
        per_call = max(1, min(n, rows))  # samples of a prompt per call (n > rows: in several calls)
        batch = max(1, rows // per_call)
        for start in range(0, len(self.prompts), batch):
            chunk = self.prompts[start : start + batch]
            left = n
            while left > 0:
                rollout = self.generator.generate(
                    chunk,
                    n=min(per_call, left),
                    greedy=greedy,
                    generator=generator,
                    max_new_tokens=self.budget,
                    temperature=temperature,
                )
                left -= min(per_call, left)
                seqs = rollout.sequences
                for text, index in zip(seqs.texts, seqs.prompt_index.tolist()):
                    prompt = chunk[index]
                    out[start + index].append((text, float(self.task.score(prompt, text))))
        return out


def sample_rows(step: int, kind: str, rows: Sequence[Scored], count: int) -> list[dict[str, Any]]:
    """Up to ``count`` (prompt, response, reward) rows of an evaluation for samples.jsonl."""
    out = []
    for row in rows[:count]:
        text, score = row.greedy if row.greedy is not None else (row.samples[0] if row.samples else ("", 0.0))
        out.append(
            {
                "step": step,
                "kind": kind,
                "prompt": row.prompt.text,
                "answer": row.prompt.answer,
                "response": text,
                "reward": score,
            }
        )
    return out


def training_samples(step: int, batch: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """Up to ``count`` (prompt, response, reward) rows of a training step's batch: its first prompt
    list, first responses and its ``rewards`` (when the graph writes that key)."""
    from flowrl.contract.data import Sequences

    prompts = next((v for v in batch.values() if isinstance(v, list) and v and isinstance(v[0], Prompt)), None)
    seqs = next((v for v in batch.values() if isinstance(v, Sequences)), None)
    if prompts is None or seqs is None:
        return []
    rewards = batch.get("rewards")
    scores = rewards.tolist() if isinstance(rewards, torch.Tensor) and rewards.numel() == len(seqs) else None
    out = []
    first: dict[int, int] = {}  # one row per prompt (its first sample), as many prompts as asked
    for i, index in enumerate(seqs.prompt_index.tolist()):
        first.setdefault(index, i)
    for index, i in list(first.items())[:count]:
        text, prompt = seqs.texts[i], prompts[index]
        row = {"step": step, "kind": "train", "prompt": prompt.text, "answer": prompt.answer, "response": text}
        row["reward"] = round(float(scores[i]), 6) if scores is not None else None
        out.append(row)
    return out


class LossEvaluator:
    """Held-out loss of a train-only graph: the trained model's mean NLL per trained token of the
    evaluation set's given responses (what its source node would read for them)."""

    def __init__(self, cfg: RunConfig, rt: Any, trainer: Any, source: Any, train_node: str) -> None:
        self.cfg, self.rt, self.trainer, self.source, self.train_node = cfg, rt, trainer, source, train_node
        self.prompts = eval_prompts(cfg, rt.task)

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.cfg.steps)

    def run(self, updates: int) -> tuple[dict[str, Any], list[Scored]]:
        """The ``eval/loss`` record after ``updates`` training steps, in chunks of a step's prompts."""
        from flowrl.runtime.offline import mean_nll, offline_sequences

        rt, total, count = self.rt, 0.0, 0
        step = max(self.cfg.rollout.prompts_per_step, 1)
        for start in range(0, len(self.prompts), step):
            chunk = self.prompts[start : start + step]
            seqs, _ = offline_sequences(
                chunk, rt.task, rt.tokenizer, rt.pad_id, rows=self.source.rows, budget=rt.response_budget,
                node=self.source.name,
            )  # fmt: skip
            with torch.no_grad():
                logprobs = self.trainer.forward(seqs, "logprobs", rt.micro_batch.get(self.train_node, 0))
            nll, n = mean_nll(logprobs.float(), seqs)
            total, count = total + nll * n, count + n
        record: dict[str, Any] = {"step": updates, "kind": "eval", "version": self.trainer.version}
        record["eval/loss"] = round(total / max(count, 1), 6)
        record["eval/tokens"] = count
        return record, []


class PreferenceEvaluator(LossEvaluator):
    """Held-out preference pairs of a train-only graph: how often the trained model's reward (DPO's
    implicit one, or a reward model's score) ranks the chosen response above the rejected one (see the
    module's docstring)."""

    def __init__(self, cfg: RunConfig, rt: Any, trainer: Any, source: Any, train_node: str) -> None:
        super().__init__(cfg, rt, trainer, source, train_node)
        graph = rt.graph
        trained = graph.nodes[train_node].model
        self.scores = graph.models[trained].scalar_head  # a reward model: its score is the reward
        scorers = [
            n.model
            for n in graph.nodes.values()
            if n.kind == "forward" and n.output == "logprobs" and source.writes[0] in n.reads and n.model != trained
        ]
        self.reference = rt.trainers[scorers[0]] if scorers else None
        self.beta = float(rt.options.get(train_node, (None, {}))[1].get("beta", 1.0))

    @torch.no_grad()
    def rewards(self, seqs: Any, micro: int) -> torch.Tensor:
        """[B] the trained model's reward of each row: a reward model's score; DPO's implicit reward."""
        if self.scores:
            return self.trainer.forward(seqs, "scores", micro).float()
        mask = seqs.sampled_mask.float()
        reward = (self.trainer.forward(seqs, "logprobs", micro).float() * mask).sum(-1)
        if self.reference is not None:
            reward = reward - (self.reference.forward(seqs, "logprobs", micro).float() * mask).sum(-1)
        else:
            reward = reward / mask.sum(-1).clamp_min(1.0)
        return self.beta * reward

    def run(self, updates: int) -> tuple[dict[str, Any], list[Scored]]:
        """The preference record after ``updates`` training steps, in chunks of a step's prompts."""
        from flowrl.runtime.offline import offline_sequences

        rt = self.rt
        micro = rt.micro_batch.get(self.train_node, 0)
        rewards: list[torch.Tensor] = []
        step = max(self.cfg.rollout.prompts_per_step, 1)
        for start in range(0, len(self.prompts), step):
            chunk = self.prompts[start : start + step]
            seqs, _ = offline_sequences(
                chunk, rt.task, rt.tokenizer, rt.pad_id, rows="pairs", budget=rt.response_budget, node=self.source.name
            )
            rewards.append(self.rewards(seqs, micro))
        every = torch.cat(rewards) if rewards else torch.zeros(0)
        chosen, rejected = every[0::2], every[1::2]  # as the source lays pairs out: chosen 2i, rejected 2i+1
        pairs = len(chosen)
        mean = lambda t: round(float(t.float().mean()), 6) if pairs else 0.0  # noqa: E731
        record: dict[str, Any] = {"step": updates, "kind": "eval", "version": self.trainer.version}
        record["eval/preference_accuracy"] = mean(chosen > rejected)
        record["eval/margin"] = mean(chosen - rejected)
        record["eval/reward_chosen"] = mean(chosen)
        record["eval/reward_rejected"] = mean(rejected)
        record["eval/pairs"] = pairs
        return record, []
