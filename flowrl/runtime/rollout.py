"""Rollouts under a rollout policy: the versioned rollout buffer and the generation of one step.

Every generated token carries the weight version that sampled it and its behaviour log-prob
(`Sequences.versions`, `Sequences.logprobs`), so a response may span versions: generation
picks up new weights between decode chunks (async), and a partial rollout continues next step
from the tokens it has (APRIL). `RolloutBuffer` holds the responses in flight and enforces the
staleness bound eta: a sample trained at version v never holds a token older than v - eta; a
row that would is restarted from its prompt (its prompt is kept: none is lost or used twice).

`StepRollout.run` is one generate node's work for one step, as a coroutine: it yields after
each decode chunk (with the groups that finished, for streaming) and returns the step's batch.
Without partial, async or streaming it is one plain `generate` call, exactly as before.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from flowrl.contract.data import GenerateResult, Part, Prompt, Rollout, Sequences, Turn
from flowrl.contract.layout import RolloutPolicy
from flowrl.errors import BackendError
from flowrl.runtime.batch import padded_rows, ragged, select_rows
from flowrl.runtime.dispatch import concat_parts, weighted_metrics


@dataclass
class Row:
    """One response in flight: its prompt's group and its tokens so far, each with the version
    that sampled it and its behaviour log-prob."""

    group: int  # the prompt's number in the run's prompt stream
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    done_at: int = -1  # when it finished (the buffer's chunk clock): batches take groups in finish order
    started: int = 0  # the step whose generation sampled its first token
    # a multi-turn episode (`flowrl.runtime.episodes`): 1 per sampled token, 0 per environment token;
    # its turns so far; where the model's current turn began; its environment episode's number
    multi: bool = False
    action: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    turn_start: int = 0
    episode: int = -1
    ended: bool = False  # the episode is over (a finished row of a live episode is between turns)

    def oldest(self) -> int | None:
        return min(self.versions) if self.versions else None

    def cut(self, at: int) -> None:
        """Drop the tokens from ``at`` on (with their log-probs, versions and action mask)."""
        del self.tokens[at:], self.logprobs[at:], self.versions[at:], self.action[at:]

    def write(self, ids: list[int], version: int) -> None:
        """Append tokens the model reads but did not sample (an environment's or agent's text): no
        log-prob, out of the loss."""
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.action += [0.0] * len(ids)

    def restart(self, step: int) -> None:
        self.tokens, self.logprobs, self.versions = [], [], []
        self.text, self.finished, self.done_at, self.started = "", False, -1, step
        # its episode number stays: `Episodes` sees the turns gone and replaces that episode
        self.action, self.turns, self.turn_start, self.ended = [], [], 0, False


@dataclass
class RolloutBuffer:
    """The rows in flight of one generate node, grouped by prompt."""

    eta: int  # staleness bound
    rows: list[Row] = field(default_factory=list)
    prompts: dict[int, Prompt] = field(default_factory=dict)  # group -> prompt, while in flight
    drawn: int = 0  # prompts taken from the stream so far (group numbers 0 .. drawn-1)
    taken: list[int] = field(default_factory=list)  # groups handed to training, in order
    restarts: int = 0
    clock: int = 0

    def add(self, prompts: Sequence[Prompt]) -> list[int]:
        """New groups for ``prompts`` (their rows come from the engine); their group numbers."""
        groups = list(range(self.drawn, self.drawn + len(prompts)))
        self.prompts.update(zip(groups, prompts))
        self.drawn += len(prompts)
        return groups

    def groups(self) -> list[int]:
        return list(dict.fromkeys(r.group for r in self.rows))

    def enforce(self, version: int, step: int) -> int:
        """Restart every unfinished or untaken row holding a token older than ``version - eta``
        (rows trained at ``version`` may be at most eta versions old); how many restarted."""
        n = 0
        for row in self.rows:
            if self.too_old(row, version):
                row.restart(step)
                n += 1
        self.restarts += n
        return n

    def too_old(self, row: Row, version: int) -> bool:
        """Whether ``row`` holds a token older than a sample trained at ``version`` may (eta)."""
        oldest = row.oldest()
        return oldest is not None and oldest < version - self.eta

    def tick(self) -> None:
        """A decode chunk ended: stamp the rows that finished in it."""
        self.clock += 1
        for row in self.rows:
            if row.finished and row.done_at < 0:
                row.done_at = self.clock

    def finished_groups(self) -> list[int]:
        """Groups whose every row has finished, in the order they finished (then by number)."""
        by: dict[int, list[Row]] = {}
        for row in self.rows:
            by.setdefault(row.group, []).append(row)
        done = [(max(r.done_at for r in rs), g) for g, rs in by.items() if all(r.finished for r in rs)]
        return [g for _, g in sorted(done)]

    def take(self, groups: Sequence[int], version: int) -> tuple[list[Prompt], list[Row]]:
        """Hand ``groups`` to training at ``version``: their prompts and rows (grouped, in order),
        removed from the buffer. Raises if any token is older than the bound allows."""
        chosen = set(groups)
        order = {g: i for i, g in enumerate(groups)}
        rows = sorted((r for r in self.rows if r.group in chosen), key=lambda r: order[r.group])
        for row in rows:
            if self.too_old(row, version):
                raise BackendError(
                    f"rollout buffer: a sample of prompt {row.group} holds a token of version {row.oldest()}, older "
                    f"than the staleness bound {self.eta} allows at version {version}."
                )
        self.rows = [r for r in self.rows if r.group not in chosen]
        self.taken.extend(groups)
        return [self.prompts.pop(g) for g in groups], rows


# ------------------------------------------------------------------ rows <-> engine rollouts


def rows_to_rollout(rows: Sequence[Row], pad_id: int, greedy: bool, episodes: bool = False) -> Rollout:
    """Rows as one engine `Rollout`: prompts left-padded, responses right-padded; ``episodes``: with
    the rows' action masks and turns (multi-turn)."""
    prompt_ids, prompt_mask, response_ids, response_mask = padded_rows(
        [r.prompt_ids for r in rows], [r.tokens for r in rows], pad_id
    )
    r_width = response_ids.shape[1]
    logprobs = ragged([r.logprobs for r in rows], r_width, 0.0, torch.float32)
    versions = ragged([r.versions for r in rows], r_width, 0, torch.long)
    seqs = Sequences(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        prompt_index=torch.arange(len(rows)),
        texts=tuple(r.text for r in rows),
        version=min((r.oldest() for r in rows if r.versions), default=0),
        logprobs=logprobs,
        versions=versions,
        action_mask=ragged([r.action for r in rows], r_width, 0.0, torch.float32) if episodes else None,
        episodes=tuple(tuple(r.turns) for r in rows) if episodes else None,
    )
    finished = torch.tensor([r.finished for r in rows], dtype=torch.bool)
    return Rollout(sequences=seqs, logprobs=logprobs, finished=finished, greedy=greedy)


def absorb(rows: Sequence[Row], out: Rollout, version: int) -> int:
    """Append what the engine generated for ``rows`` (``out`` has them in order); returns the new tokens."""
    seqs, new = out.sequences, 0
    lengths = seqs.response_mask.sum(-1).long().tolist()
    ids, logprobs, finished = seqs.response_ids.tolist(), out.logprobs.tolist(), out.finished.tolist()
    for i, row in enumerate(rows):
        have, now = len(row.tokens), lengths[i]
        if now > have:
            row.tokens += ids[i][have:now]
            row.logprobs += logprobs[i][have:now]
            row.versions += [version] * (now - have)
            if row.multi:
                row.action += [1.0] * (now - have)
            new += now - have
        row.text = seqs.texts[i]
        row.finished = bool(finished[i])
    return new


def fresh_rows(groups: Sequence[int], out: Rollout, n: int, version: int, step: int, multi: bool = False) -> list[Row]:
    """Rows for new groups from the engine's first call (``n`` rows a group, in order); ``multi``:
    rows of multi-turn episodes."""
    seqs = out.sequences
    prompt_ids, prompt_mask = seqs.prompt_ids.tolist(), seqs.prompt_mask.tolist()
    rows = []
    for i in range(len(seqs)):
        ids = [t for t, m in zip(prompt_ids[i], prompt_mask[i]) if m]
        rows.append(Row(group=groups[i // n], prompt_ids=ids, started=step, multi=multi))
    absorb(rows, out, version)
    return rows


def _take_groups(
    prompts: Sequence[Prompt],
    seqs: Sequences,
    outputs: dict[str, Any],
    groups: torch.Tensor,
    rows_kept: torch.Tensor | None = None,
) -> tuple[list[Prompt], Sequences, dict[str, Any]]:
    """The rows of prompt numbers ``groups`` (in that order; only those ``rows_kept`` marks, when
    given), renumbered 0..len(groups)-1, with the same rows of each per-row output."""
    order = {int(g): i for i, g in enumerate(groups)}
    mine = [r for g in order for r in (seqs.prompt_index == g).nonzero().flatten().tolist()]
    rows = torch.tensor([r for r in mine if rows_kept is None or bool(rows_kept[r])], dtype=torch.long)
    picked = replace(seqs.select(rows), prompt_index=torch.tensor([order[int(g)] for g in seqs.prompt_index[rows]]))
    return [prompts[int(g)] for g in groups], picked, select_rows(outputs, rows, len(seqs))


# ------------------------------------------------------------------ one step of a generate node


@dataclass
class Chunk:
    """What a generate coroutine yields after a decode chunk: parts ready for streaming."""

    parts: list[Part]  # finished groups ready for streaming


@dataclass
class Rounds:
    """Dynamic sampling for a generate node whose rows a filter keeps: ``run(prompts, seqs,
    logprobs)`` runs the nodes between the generate node and the filter, then the filter, on one
    round's rows; it returns (their outputs by key, the kept groups as a bool per prompt, each
    node's (seconds, metrics)). Rounds draw ``prompts_per_step`` more prompts until ``groups`` passed, at
    most ``max_rounds``."""

    run: Callable[
        [list[Prompt], Sequences, Any], tuple[dict[str, Any], torch.Tensor, dict[str, tuple[float, dict[str, Any]]]]
    ]
    groups: int
    max_rounds: int
    filter: str  # the filter node's name (its metrics)
    rows: bool = False  # the kept value is one bool per row (a filter with by_row), else per group


@dataclass
class StepRollout:
    """The rollouts of one generate node across steps, under the plan's rollout policy."""

    model: str
    generator: Any  # the model's GenerationGroup
    n: int  # samples per prompt
    greedy: bool
    policy: RolloutPolicy
    prompts_per_step: int
    chunk_tokens: int
    stream_groups: int
    pad_id: int
    draw: Callable[[int], list[Prompt]]  # the next prompts of the run's stream
    rounds: Rounds | None = None  # a filter keeps groups of this node's rows (dynamic sampling)
    episodes: Any = None  # multi-turn: an `Episodes` that runs the environment between turns
    agents: Any = None  # agent episodes: `flowrl.runtime.agents.AgentRollouts`
    buffer: RolloutBuffer = field(init=False)

    def __post_init__(self) -> None:
        self.buffer = RolloutBuffer(eta=self.policy.staleness)

    def close(self) -> None:
        """Stop what the rollouts keep between steps (the agents' endpoint)."""
        if self.agents is not None:
            self.agents.close()

    def run(
        self, step: int, version: int, prompts: Sequence[Prompt] | None, rng: torch.Generator
    ) -> Generator[Chunk, None, GenerateResult]:
        """Generate the batch trained at ``version`` (step ``step``). Yields a `Chunk` after each
        decode chunk; returns the step's `GenerateResult`.
        ``prompts``: the step's prompts (None when partial: the buffer draws its own)."""
        gen = self.generator
        if not self.policy.chunked:  # one call, one version
            assert prompts is not None
            if self.rounds is not None:
                return self._dynamic(list(prompts), version, rng)
            seqs, tokens = self._sample(prompts, rng)
            self.buffer.taken.extend(self.buffer.add(prompts))
            self.buffer.prompts.clear()
            metrics = {**self._metrics(seqs, tokens, version, 0, 0), "carried": 0, "in_flight": 0}
            metrics.update(self._turn_metrics(seqs))
            return GenerateResult(None, seqs, metrics, [Part(seqs, list(prompts))])
        buf = self.buffer
        agents = self.agents
        restarted = agents.enforce(buf, version, step) if agents is not None else buf.enforce(version, step)
        carried = len(buf.groups())
        before = {id(r): len(r.tokens) for r in buf.rows}  # tokens sampled in earlier steps (recycled)
        want = self.prompts_per_step
        if self.policy.partial:
            launch = math.ceil(self.prompts_per_step * (1 + self.policy.overprovision))
            new_prompts = self.draw(max(launch - carried, 0))
        else:
            new_prompts = list(prompts or ())
        new_groups = buf.add(new_prompts)
        mine = set(new_groups)
        generated = 0
        emitted: list[int] = []
        parts: list[Part] = []
        episodes = self.episodes
        of = lambda row: buf.prompts[row.group]  # noqa: E731
        while True:
            todo = [r for r in buf.rows if not r.finished]
            if agents is not None:  # the agents' requests, a decode chunk of those in flight
                if new_prompts:
                    buf.rows.extend(agents.launch(new_groups, new_prompts, self.n, step))
                    new_prompts = []
                generated += agents.pump(gen, rng, gen.version, self.chunk_tokens)
                todo = []
            if new_prompts:  # the first chunk of new prompts: the engine tokenises them
                engine_prompts = new_prompts if episodes is None else [episodes.prompt(p) for p in new_prompts]
                out = gen.generate(
                    engine_prompts, n=self.n, greedy=self.greedy, generator=rng, max_new_tokens=self.chunk_tokens
                )
                fresh = fresh_rows(new_groups, out, self.n, gen.version, step, multi=episodes is not None)
                generated += sum(len(r.tokens) for r in fresh)
                buf.rows.extend(fresh)
                new_prompts = []
                if episodes is not None:
                    episodes.advance(fresh, of, gen.version)
            if todo:
                out = gen.resume(
                    rows_to_rollout(todo, self.pad_id, self.greedy), generator=rng, max_new_tokens=self.chunk_tokens
                )
                generated += absorb(todo, out, gen.version)
                if episodes is not None:  # model turns that ended get their environment's answer
                    episodes.advance(todo, of, gen.version)
            buf.tick()
            taken = set(emitted)
            done = [g for g in buf.finished_groups() if g not in taken and (self.policy.partial or g in mine)]
            ready = done[: want - len(emitted)]
            full = len(emitted) + len(ready) >= want
            new_parts = []
            if ready and (full or (self.policy.streaming and len(ready) >= self.stream_groups)):
                new_parts = [self._part(ready, len(emitted), new_groups)]
                parts += new_parts
                emitted += ready
            if full:
                break
            if all(r.finished for r in buf.rows) and agents is None:
                raise BackendError(
                    f"rollout of model '{self.model}': every response finished, but the batch is not full."
                )
            yield Chunk(parts=new_parts)
        batch_prompts, rows = buf.take(emitted, version)
        seqs = Sequences.concat([p.sequences for p in parts], self.pad_id, [0] * len(parts))
        recycled = sum(before.get(id(r), 0) for r in rows)
        metrics = self._metrics(seqs, generated, version, restarted, recycled)
        metrics.update(carried=carried, in_flight=len(buf.groups()))
        metrics.update(self._turn_metrics(seqs))
        return GenerateResult(batch_prompts if self.policy.partial else None, seqs, metrics, parts)

    def _sample(self, prompts: Sequence[Prompt], rng: torch.Generator) -> tuple[Sequences, int]:
        """One generation call for ``prompts`` at the engine's version (an episode per row with an
        environment); the responses with their log-probs and versions, and the tokens sampled."""
        gen = self.generator
        if self.agents is not None:
            seqs = self.agents.run(gen, prompts, self.n, rng, gen.version)
        elif self.episodes is not None:
            seqs = self.episodes.run(gen, prompts, self.n, rng, gen.version, greedy=self.greedy)
        else:
            out = gen.generate(prompts, n=self.n, greedy=self.greedy, generator=rng)
            seqs = replace(out.sequences, logprobs=out.logprobs)
        seqs = replace(
            seqs,
            version=gen.version,
            versions=torch.full_like(seqs.response_ids, gen.version) * seqs.response_mask.long(),
        )
        return seqs, int(seqs.sampled_mask.sum())

    def _dynamic(self, prompts: list[Prompt], version: int, rng: torch.Generator) -> GenerateResult:
        """Dynamic sampling (DAPO): generate, score and filter rounds of prompts until the filter
        passed ``rounds.groups`` groups or ``rounds.max_rounds`` rounds ran; the batch holds the first
        groups that passed (every group of the last round when none did). The result carries the
        between nodes' outputs and the metrics of each of them and of the filter."""
        assert self.rounds is not None
        want, kept, tokens = self.rounds.groups, [], 0
        sampled = passed = rounds = 0
        node_runs: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        node_seconds: dict[str, float] = {}
        episode_runs: list[tuple[int, dict[str, Any]]] = []
        last: tuple[list[Prompt], Sequences, dict[str, Any], torch.Tensor] | None = None
        while passed < want and rounds < self.rounds.max_rounds:
            if rounds:
                prompts = self.draw(self.prompts_per_step)
            rounds += 1
            seqs, n_tokens = self._sample(prompts, rng)
            tokens += n_tokens
            if self.episodes is not None or self.agents is not None:
                episode_runs.append((len(seqs), self._turn_metrics(seqs)))
            outputs, keep, metrics = self.rounds.run(prompts, seqs, seqs.logprobs)
            rows_kept = None
            if self.rounds.rows:  # one bool per row: a group passes when any of its rows does
                rows_kept = keep
                keep = torch.zeros(len(prompts), dtype=torch.bool)
                keep[seqs.prompt_index[rows_kept]] = True
            for node, (took, m) in metrics.items():
                node_runs.setdefault(node, []).append((len(seqs), m))
                node_seconds[node] = node_seconds.get(node, 0.0) + took
            sampled += len(prompts)
            groups = keep.nonzero().flatten().tolist()
            passed += len(groups)
            last = (prompts, seqs, outputs, torch.arange(len(prompts)))
            take = groups[: max(want - sum(len(k[0]) for k in kept), 0)]
            if take:
                kept.append(_take_groups(prompts, seqs, outputs, torch.tensor(take), rows_kept))
        fallback = not kept
        if fallback:  # nothing passed
            assert last is not None
            if self.rounds.rows:  # no row: an empty batch (the train node skips its step)
                kept.append(_take_groups(*last, rows_kept=torch.zeros(len(last[1]), dtype=torch.bool)))
            else:  # train on the last round as it is (a filtered-out group adds no gradient)
                kept.append(_take_groups(*last))
        batch_prompts = [p for k in kept for p in k[0]]
        offsets = list(itertools.accumulate([0] + [len(k[0]) for k in kept[:-1]]))
        seqs = Sequences.concat([k[1] for k in kept], self.pad_id, offsets)
        extra = {key: concat_parts([k[2][key] for k in kept]) for key in kept[0][2]}
        self.buffer.taken.extend(self.buffer.add(batch_prompts))
        self.buffer.prompts.clear()
        metrics = {**self._metrics(seqs, tokens, version, 0, 0), "carried": 0, "in_flight": 0}
        if episode_runs:  # over every round's episodes
            metrics.update(weighted_metrics(episode_runs))
        nodes = {node: (node_seconds[node], weighted_metrics(runs)) for node, runs in node_runs.items()}
        nodes[self.rounds.filter] = (
            node_seconds.get(self.rounds.filter, 0.0),
            {
                "rounds": rounds,
                "acceptance": round(passed / max(sampled, 1), 4),
                "groups": len(batch_prompts),
                "fallback": int(fallback),
            },
        )
        return GenerateResult(batch_prompts, seqs, metrics, [Part(seqs, batch_prompts)], outputs=extra, nodes=nodes)

    def _turn_metrics(self, seqs: Sequences) -> dict[str, Any]:
        """The episodes' metrics (an environment's or an agent's) over ``seqs``."""
        source = self.agents if self.agents is not None else self.episodes
        return source.take_metrics(seqs) if source is not None else {}

    def _part(self, groups: Sequence[int], first: int, new_groups: Sequence[int]) -> Part:
        """The rows of finished ``groups`` as Sequences whose prompt_index numbers the batch's
        prompts (partial: in the order groups are taken) or the step's own prompts (otherwise),
        with their behaviour log-probs, and their groups' prompts."""
        rows = [r for g in groups for r in self.buffer.rows if r.group == g]
        multi = self.episodes is not None or self.agents is not None
        rollout = rows_to_rollout(rows, self.pad_id, self.greedy, episodes=multi)
        if self.policy.partial:
            index = {g: first + i for i, g in enumerate(groups)}
        else:
            index = {g: i for i, g in enumerate(new_groups)}
        seqs = replace(rollout.sequences, prompt_index=torch.tensor([index[r.group] for r in rows]))
        return Part(seqs, [self.buffer.prompts[g] for g in groups])

    def _metrics(self, seqs: Sequences, generated: int, version: int, restarted: int, recycled: int) -> dict[str, Any]:
        tokens = max(seqs.num_tokens(), 1)
        ages = torch.zeros(len(seqs), dtype=torch.long)
        if seqs.versions is not None and seqs.versions.numel():
            ages = version - torch.where(seqs.response_mask.bool(), seqs.versions, version).min(-1).values
        out: dict[str, Any] = {
            "tokens": generated,
            "samples": len(seqs),
            "staleness_mean": round(float(ages.float().mean()) if len(seqs) else 0.0, 4),
            "staleness_max": int(ages.max()) if len(seqs) else 0,
            "recycled_tokens": round(recycled / tokens, 4),
            "restarted": restarted,
        }
        for age in range(self.policy.staleness + 1):  # the staleness histogram: fraction of samples per age
            out[f"staleness_{age}"] = round(float((ages == age).float().mean()) if len(seqs) else 0.0, 4)
        return out
