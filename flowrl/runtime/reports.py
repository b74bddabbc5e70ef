"""What a run reports besides its step metrics: evaluations (``eval.every``) and sample rows.

- Evaluation records go to metrics.jsonl (``{"step": UPDATES, "kind": "eval", "eval/...": ...}``,
  UPDATES being the training steps done: 0 before training), the trackers, ``RunResult.evals``
  and the progress output.
- ``samples.jsonl`` gets ``log.samples`` (prompt, answer, response, reward) rows at every
  evaluation and every ``log.samples_every`` training steps; the progress output shows them too.

``on_step`` (the CLI's progress) receives step records, and records with a ``kind``: ``eval``
(an evaluation's metrics) and ``samples`` (``rows``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import msgspec

from flowrl.contract.reading import generating_models
from flowrl.errors import ConfigError
from flowrl.runtime.evaluate import Evaluator, LossEvaluator, PairEvaluator, sample_rows, training_samples

SAMPLES = "samples.jsonl"


class Reports:
    """Evaluations and sample rows of one run, written beside its metrics."""

    def __init__(
        self,
        cfg: Any,
        plan: Any,
        parts: Any,
        out_dir: Path,
        log: Any,
        result: Any,
        on_step: Callable[[dict[str, Any]], None] | None,
        resume: bool,
    ) -> None:
        self.cfg, self.log, self.result, self.on_step = cfg, log, result, on_step
        self.evaluator: Evaluator | LossEvaluator | None = None
        graph = parts.rt.graph
        if cfg.eval.every > 0 and not generating_models(graph) and graph.sources():  # held-out loss
            source = graph.sources()[0]
            train = next(n for n in graph.nodes.values() if n.trains and source.writes[0] in n.reads)
            scorer = graph.models[train.model].scalar_head and source.rows == "pairs"  # a reward model: its pairs
            kind = PairEvaluator if scorer else LossEvaluator
            self.evaluator = kind(cfg, parts.rt, parts.trainers[train.model], source, train.name)
        elif cfg.eval.every > 0:
            policy = next(iter(generating_models(parts.rt.graph)), None)
            if policy is None or policy not in parts.generators:
                raise ConfigError("eval.every is set, but the graph generates nothing to evaluate: set eval.every=0.")
            budget = plan.models[policy].sampling.max_new_tokens
            self.evaluator = Evaluator(cfg, parts.rt.task, parts.generators[policy], budget)
        path = out_dir / SAMPLES
        if resume:
            _keep_until(path, result.resumed_from or 0)
        self.samples: IO[str] = path.open("a" if resume else "w")

    def eval_due(self, step: int) -> bool:
        return self.evaluator is not None and self.evaluator.due(step)

    def evaluate(self, updates: int) -> None:
        """An evaluation after ``updates`` training steps, when one is due then (0: before training)."""
        if self.evaluator is None or not (updates == 0 or self.evaluator.due(updates - 1)):
            return
        record, rows = self.evaluator.run(updates)
        self.log.log_extra(record)
        self.result.evals.append(record)
        self._notify(record)
        self._write(sample_rows(updates, "eval", rows, self.cfg.log.samples))

    def step_done(self, step: int, state: Any) -> None:
        self.log.step_done(step, state)
        every = self.cfg.log.samples_every
        if every and (step + 1) % every == 0:
            self._write(training_samples(step, state.batch, self.cfg.log.samples))

    def close(self) -> None:
        self.samples.close()

    def _write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.samples.writelines(msgspec.json.encode(r).decode() + "\n" for r in rows)
        self.samples.flush()
        self._notify({"kind": "samples", "rows": rows})

    def _notify(self, record: dict[str, Any]) -> None:
        if self.on_step is not None:
            self.on_step(record)


def _keep_until(path: Path, first_step: int) -> None:
    """samples.jsonl of a resumed run without the rows of steps after its checkpoint (they run again)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = msgspec.json.decode(line)
        except msgspec.DecodeError:
            break
        step = row.get("step", 0) if isinstance(row, dict) else 0
        if (row.get("kind") == "eval" and step <= first_step) or (row.get("kind") != "eval" and step < first_step):
            kept.append(line + "\n")
    path.write_text("".join(kept))
