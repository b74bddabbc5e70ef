"""Discrete-event simulator: several iterations of a graph under a ClusterPlan.

Each graph node becomes a task on the device group(s) it needs; a group runs one task at a
time (colocated models time-share), different groups run concurrently. Response lengths are
sampled from the workload every iteration, so a long tail costs what it costs: a replica
decodes until its longest response ends, with its live batch shrinking as responses finish.
Rollout policies change the dependencies: generation of step k needs the weights of step
k-1-lead (the policy's lead: 0 sync, 1 one-step-off, eta async), and partial rollouts stop
once the batch is full and resume the rest later.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import msgspec
import numpy as np

from flowrl.contract.layout import ClusterPlan
from flowrl.contract.numerics import Numerics
from flowrl.contract.workload import WorkloadSpec, mean_length, sample_lengths
from flowrl.graph.ir import Forward, Graph, streamed_nodes
from flowrl.planner.cost import CostModel
from flowrl.planner.memory import kv_capacity
from flowrl.planner.space import Roles


@dataclass
class Span:
    iteration: int
    task: str
    groups: tuple[str, ...]
    start: float
    end: float


@dataclass
class SimResult:
    iteration_s: float
    breakdown: dict[str, float]
    utilization: dict[str, float]
    spans: list[Span] = field(default_factory=list)
    flops: float = 0.0
    gen_steps: float = 0.0
    longest_decode: int = 0  # the longest response actually decoded (for the roofline)


# ------------------------------------------------------------------ generation


def decode_seconds(cost: CostModel, lengths: np.ndarray, prompt: int, tp: int, cap: int) -> float:
    """One replica decodes ``lengths`` (remaining tokens per sequence), at most ``cap`` at a time."""
    if lengths.size == 0:
        return 0.0
    waves = max(1, int(np.ceil(lengths.size / max(cap, 1))))
    total = 0.0
    ordered = np.sort(lengths)
    for w in range(waves):
        part = ordered[w::waves]
        steps = int(part.max())
        t = np.arange(1, steps + 1)
        live = part.size - np.searchsorted(part, t, side="left")  # sequences still decoding at step t
        total += float(np.sum(cost.decode_step(live.astype(float), prompt + t.astype(float), tp)))
        total += cost.prefill(part.size, prompt, tp)
    return total


def continuous_seconds(cost: CostModel, lengths: np.ndarray, prompt: int, tp: int, slots: int) -> float:
    """One replica decodes ``lengths`` with continuous batching: at most ``slots`` sequences at once,
    each next one admitted (in order) as soon as one finishes; a step's cost follows its live batch
    and the tokens their paged KV cache holds."""
    if lengths.size == 0:
        return 0.0
    slots = max(1, min(slots, lengths.size))
    if slots == lengths.size:
        ends = lengths.astype(np.int64)
    else:
        heap = [0] * slots  # when each slot frees, in decode steps
        for n in lengths.tolist():
            heapq.heapreplace(heap, heap[0] + n)
        ends = np.asarray(heap, dtype=np.int64)
    ends.sort()
    t = np.arange(1, int(ends[-1]) + 1)
    live = slots - np.searchsorted(ends, t, side="left")
    context = prompt + np.minimum(t, live_half(lengths))
    total = float(np.sum(cost.decode_step(live.astype(float), context, tp)))
    return total + cost.prefill(lengths.size, prompt, tp)


def paged_context(workload: WorkloadSpec) -> float:
    """Tokens the KV cache holds per live sequence on average under continuous batching: the prompt
    plus half a response, length-biased (long responses stay live longer)."""
    return workload.prompt_length + live_half(sample_lengths(workload.response_length, 4096, np.random.default_rng(0)))


def live_half(lengths: np.ndarray) -> float:
    """The response tokens a live sequence holds on average: half a response, length-biased (a long
    response stays live longer), ``sum(L^2) / (2 sum(L))``."""
    lengths = lengths.astype(float)
    return float(np.sum(lengths**2) / (2 * max(float(lengths.sum()), 1.0)))


class Generator:
    """Per-iteration generation time across replicas, with partial-rollout carry-over.

    A static-batch engine (``Numerics.decode_batch`` None, or ``static_decode``: batches of at most
    ``decode_batch``) decodes waves of as many sequences as fit at full length, each wave until its
    longest response ends; a continuous-batching engine
    keeps up to ``decode_batch`` sequences live, as many as its paged KV cache holds. When resident
    training states would crowd that KV cache, they go to host memory for the rollout
    (``offloaded``: the bytes per device, whose round trip the weight sync pays)."""

    def __init__(
        self,
        plan: ClusterPlan,
        cost: CostModel,
        workload: WorkloadSpec,
        static_bytes: int,
        rng: np.random.Generator,
        sampled_replicas: int | None = None,
        numerics: Numerics | None = None,
        model: str | None = None,
    ) -> None:
        self.plan, self.cost, self.w, self.rng = plan, cost, workload, rng
        self.layout = gen = plan.generation_of(model) if model is not None else plan.generation
        numerics = numerics or Numerics()
        self.continuous = not numerics.static
        self.offloaded = 0
        if self.continuous:
            context = int(paged_context(workload))
            wanted = min(numerics.decode_batch, max(1, -(-workload.sequences // gen.replicas)))
            self.cap = min(
                numerics.decode_batch, kv_capacity(cost.model, numerics, cost.hw, gen.tp, static_bytes, context)
            )
            if numerics.offload_for_rollout and static_bytes and self.cap < wanted:
                self.offloaded = static_bytes
                self.cap = min(numerics.decode_batch, kv_capacity(cost.model, numerics, cost.hw, gen.tp, 0, context))
        else:
            context = workload.prompt_length + workload.max_response()
            self.cap = kv_capacity(cost.model, numerics, cost.hw, gen.tp, static_bytes, context)
            if numerics.decode_batch is not None:  # static batches of at most decode_batch
                self.cap = min(self.cap, numerics.decode_batch)
        # Replicas are i.i.d.: simulate a sample of them (each with its real share of the batch).
        self.simulated = min(gen.replicas, sampled_replicas or gen.replicas)
        # partial rollouts carried over, per group size (a generate node's samples per prompt) and replica:
        # the tokens each response has left to decode, and those it has
        self.carry: dict[int, list[np.ndarray]] = {}
        self.carried: dict[int, list[np.ndarray]] = {}
        self.longest = 0
        # streaming: the share of the last batch's rows whose groups finished in the last decode chunk (the
        # part that reaches the scoring nodes when generation ends; the others reached them while it went on)
        self.last_part = 1.0

    def iteration(self, sequences: int, group: int = 1) -> tuple[float, float, np.ndarray]:
        """(seconds, generated tokens over all replicas, the response lengths of the batch trained)
        for one batch of ``sequences`` responses in groups of ``group`` (the samples of a prompt).

        Partial rollouts launch (1 + overprovision) x the groups, decode until the batch has its
        groups (a group is done when its longest response is), and carry the other groups over:
        their remaining tokens, and the tokens they have, which training later pays for. The batch
        fills from every replica's finished groups (one buffer): decoding stops at the order statistic
        of the groups' lengths over all replicas, not at each replica's own."""
        gen, pol = self.layout, self.plan.rollout
        group = max(group, 1)
        per_replica = int(np.ceil(sequences / gen.replicas / group))  # groups
        launch = int(np.ceil(per_replica * (1 + pol.overprovision))) if pol.partial else per_replica
        chunked = pol.partial or pol.streaming or pol.mode == "async"
        slowest, tokens, batch = 0.0, 0.0, []
        empty = [np.zeros(0, dtype=np.int64) for _ in range(self.simulated)]
        carry_of, carried_of = self.carry.setdefault(group, list(empty)), self.carried.setdefault(group, list(empty))
        actives, befores = [], []
        for r in range(self.simulated):
            carry, carried = carry_of[r].reshape(-1, group), carried_of[r].reshape(-1, group)
            new = max(launch - carry.shape[0], 0)
            fresh = sample_lengths(self.w.response_length, new * group, self.rng).reshape(new, group)
            actives.append(np.concatenate([carry, fresh]))
            befores.append(np.concatenate([carried, np.zeros_like(fresh)]))
        stop = None
        pooled = np.concatenate([a.max(1) for a in actives]) if actives else np.zeros(0)
        if pol.partial and pooled.size > per_replica * self.simulated:
            # decode until the batch has its groups: the (per_replica x replicas)-th group to finish
            stop = int(np.sort(pooled)[per_replica * self.simulated - 1])
        finishes = []  # per replica: when each group of the batch finished, in this step's decode steps
        for r, (active, before) in enumerate(zip(actives, befores)):
            longest = active.max(1) if active.size else np.zeros(0, dtype=np.int64)
            if stop is not None:
                ends = longest <= stop
                done = np.minimum(active, stop)
                carry_of[r] = np.maximum(active - stop, 0)[~ends].ravel()
                carried_of[r] = (before + done)[~ends].ravel()
                batch.append((before + active)[ends].ravel())
                finishes.append(np.repeat(longest[ends], group))
            else:
                done = active
                carry_of[r] = carried_of[r] = np.zeros(0, dtype=np.int64)
                batch.append((before + active).ravel())
                finishes.append(np.repeat(longest, group))
            done, before = done.ravel(), before.ravel()
            decode = continuous_seconds if self.continuous else decode_seconds
            seconds = decode(self.cost, done[done > 0], self.w.prompt_length, gen.tp, self.cap)
            seconds += self.cost.hw.generate_overhead  # the call's setup around its steps
            if chunked:  # every chunk boundary re-reads prompt + response so far for the rows still going
                chunk = pol.chunk(self.w.max_response())
                seconds += restart_seconds(self.cost, done, before, self.w.prompt_length, gen.tp, chunk)
                # and each chunk is an engine call of its own (flowrl.runtime.rollout), with the call's setup
                calls = -(-int(done.max()) // chunk) if done.size else 1
                seconds += (calls - 1) * self.cost.hw.generate_overhead
            if self.w.turns > 1:  # episodes: each later turn re-reads the context, after the environment answers
                seconds += episode_seconds(self.cost, done, self.w, gen.tp)
            slowest = max(slowest, seconds)
            tokens += float(done.sum())
            self.longest = max(self.longest, int(done.max()) if done.size else 0)
        ended = np.concatenate(finishes) if finishes else np.zeros(0, dtype=np.int64)
        if ended.size and pol.chunked:  # parts leave at chunk boundaries: the last holds what the last chunk finished
            chunk = pol.chunk(self.w.max_response())
            last = (int(ended.max()) - 1) // chunk * chunk  # the last boundary before generation ends
            self.last_part = float(np.mean(ended > last))
        return slowest, tokens * gen.replicas / self.simulated, np.concatenate(batch)


def restart_seconds(
    cost: CostModel, lengths: np.ndarray, before: np.ndarray, prompt: int, tp: int, chunk: int
) -> float:
    """The prefills a chunked decode adds: at each chunk boundary the rows still decoding start
    again from their prompt and the tokens they have."""
    total = 0.0
    for at in range(chunk, int(lengths.max()) if lengths.size else 0, chunk):
        live = lengths > at
        if live.any():
            total += cost.prefill(int(live.sum()), prompt + int(np.mean(before[live])) + at, tp)
    return total


def episode_seconds(cost: CostModel, lengths: np.ndarray, workload: WorkloadSpec, tp: int) -> float:
    """What multi-turn episodes add to decoding ``lengths`` (whole episodes): at each of the
    ``turns - 1`` turn boundaries, every episode's environment answers (``env_s_per_turn``, one after
    another in the driver) and the engine prefills prompt + episode so far again."""
    turns = workload.turns
    if not lengths.size or turns < 2:
        return 0.0
    total = 0.0
    for k in range(1, turns):
        so_far = int(np.mean(lengths)) * k // turns
        total += cost.prefill(int(lengths.size), workload.prompt_length + so_far, tp)
    return total + workload.env_s_per_turn * (turns - 1) * int(lengths.size)


def padded_length(lengths: np.ndarray, prompt: int, rows: int) -> float:
    """Mean sequence length a forward or train pass computes: the runtime cuts micro-batches of
    ``rows`` rows of similar response length, each padded to its longest."""
    if lengths.size == 0:
        return float(prompt)
    ordered = np.sort(lengths)
    rows = max(rows, 1)
    starts = np.arange(0, ordered.size, rows)
    ends = np.minimum(starts + rows, ordered.size)
    padded = float(np.sum((ends - starts) * ordered[ends - 1].astype(float)))
    return prompt + padded / ordered.size


@dataclass(frozen=True)
class MicroBatching:
    """How forward and train passes cut their rows into micro-batches (``train.max_tokens_per_micro_batch``,
    ``train.pack``): ``max_tokens`` None cuts micro-batches of the layout's rows, each padded to its longest;
    a token budget fills a micro-batch with rows of similar length until it holds ``max_tokens`` tokens (at
    most the layout's rows; a longer row alone); ``pack`` computes each micro-batch's real tokens, unpadded;
    ``pad_to`` (`WorkloadSpec.padded_to`: a trainer without remove-padding) computes every row at that length."""

    max_tokens: int | None = None
    pack: bool = False
    pad_to: int | None = None

    def cut(
        self, lengths: np.ndarray, prompt: int, micro_batch: int, dp: int, rows: int | None = None
    ) -> tuple[int, int]:
        """(rows per micro-batch, tokens per row a pass computes) for a step's response ``lengths``, cut over
        ``dp`` ranks (``rows``: the rows the layout was sized for, when a partial step's batch differs)."""
        rows = rows or max(lengths.size, 1)
        real = prompt + (float(np.mean(lengths)) if lengths.size else 0.0)
        if self.pad_to is not None:
            seq = float(self.pad_to)
        elif self.pack:
            seq = real
        else:
            seq = padded_length(lengths, prompt, max(1, micro_batch * dp * lengths.size // rows))
        if self.max_tokens is None:
            return micro_batch, int(round(seq))
        size = max(1, min(micro_batch, int(self.max_tokens // max(seq, 1.0))))
        if not self.pack and self.pad_to is None:  # padded within the smaller micro-batches the budget allows
            seq = padded_length(lengths, prompt, max(1, size * dp * lengths.size // rows))
        return size, int(round(seq))

    def memory_rows(self, micro_batch: int, longest: int) -> int:
        """The rows of the largest micro-batch a pass may hold at once: the layout's, or as many of the
        longest sequences as the budget holds (one at least)."""
        if self.max_tokens is None:
            return micro_batch
        return max(1, min(micro_batch, self.max_tokens // max(longest, 1)))


# ------------------------------------------------------------------ the schedule


def node_group(plan: ClusterPlan, graph: Graph, name: str) -> tuple[str, ...]:
    node = graph.nodes[name]
    if node.samples:  # on its model's generation layout
        return (plan.generation_of(node.model).group,)
    if node.model is not None:
        return (plan.layout(node.model).group,)
    return ()  # controller work


def sync_seconds(plan: ClusterPlan, cost: CostModel, roles: Roles, model: str | None = None) -> float:
    """Move a generating model's new weights (default: the actor's; ``cost``: that model's) into its
    generation layout (and load them into its engine)."""
    gen = plan.generation_of(model or roles.actor)
    return _transfer_seconds(plan, cost, model or roles.actor) + cost.engine_load(cost.sync_volume() / gen.tp)


def _transfer_seconds(plan: ClusterPlan, cost: CostModel, model: str) -> float:
    """The weights' way from the trainer to the generation layout: the strategy's bytes and latencies, plus the
    host's work per tensor moved."""
    return _moved_seconds(plan, cost, model) + cost.param_tensors * cost.hw.sync_tensor_overhead


def _moved_seconds(plan: ClusterPlan, cost: CostModel, model: str) -> float:
    actor = plan.layout(model)
    volume = cost.sync_volume()
    ws = plan.weight_sync
    # a trainer sharded over dp (FSDP) gathers its full weights first: one all-gather per tensor
    gather = cost.param_tensors * cost.link(actor.parallel.size)[1] if actor.parallel.dp > 1 else 0.0
    if ws.strategy == "reshard":  # 3D-HybridEngine: all-gather within the group, no cross-group copy
        p, tp_gen = actor.parallel, plan.generation_of(model).tp
        bw, lat = cost.link(p.size)
        if p.pp == 1 and p.tp == tp_gen:  # split alike: each rank gathers its own tp slices over dp
            gathered = volume / p.tp * (p.dp - 1) / p.dp
        else:  # each rank gathers the whole model and keeps its generation slice
            gathered = volume * (p.size - 1) / p.size
        tensors = cost.param_tensors * lat if p.size > 1 else 0.0
        return tensors + gathered / bw + cost.stream(volume / tp_gen)
    src = plan.group(actor.group)
    dst = plan.group(plan.generation_of(model).group)
    bw, lat = cost.link(src.devices + dst.devices)
    links = min(src.devices, dst.devices)  # parallel streams between the groups
    if ws.strategy == "full":  # gather on the trainer, then one broadcast per tensor to every replica
        return gather + 2 * volume / (bw * links) + cost.param_tensors * lat
    if ws.strategy == "bucketed":  # pipelined 64 MiB buckets: one pass over the links
        return gather + volume / (bw * links) + (volume // (64 * 2**20) + 1) * lat
    # sparse delta: only changed weights, values + indices, plus encode/decode passes
    return gather + ws.density * volume * 1.5 / (bw * links) + 2 * cost.stream(volume / src.devices) + 16 * lat


def simulate(
    graph: Graph,
    plan: ClusterPlan,
    cost: CostModel | Mapping[str, CostModel],
    workload: WorkloadSpec,
    roles: Roles,
    *,
    static_gen_bytes: int,
    iterations: int = 4,
    seed: int = 0,
    sampled_replicas: int | None = None,
    numerics: Numerics | None = None,
    node_rows: dict[str, int] | None = None,
    train_steps: Mapping[str, tuple[int, int]] | None = None,
    fused: Collection[str] = (),
    in_place: Collection[str] = (),
    batching: MicroBatching = MicroBatching(),
) -> SimResult:
    """Simulate ``iterations`` steps of ``plan``. ``cost``: one cost model for every graph model, or
    one per model (per-role models). ``node_rows``: the sequences each node sees per step (default:
    the workload's prompts x samples, one per prompt for a greedy generate node). ``train_steps``:
    a train node's own (epochs, mini-batches), where its options set them (default: the workload's);
    ``fused``: forward nodes their train node computes (``ExecutionPlan.fused``), taking no time;
    ``in_place``: policies that sample with their training engine's weights as they are (`samples_in_place`):
    no sync to run. ``batching``: how forward and train passes cut micro-batches (token budget, packing)."""
    rng = np.random.default_rng(seed)
    order = graph.order()
    costs = dict(cost) if isinstance(cost, Mapping) else {m: cost for m in graph.models}
    gens = {
        m: Generator(plan, costs[m], workload, static_gen_bytes, rng, sampled_replicas, numerics, model=m)
        for m in roles.policies
    }
    lead = plan.rollout.lead
    warm = 1 + lead  # iterations before the pipeline of rollouts is full
    iterations = max(iterations, warm + 2)
    free: dict[str, float] = {g.name: 0.0 for g in plan.groups}
    busy: dict[str, float] = {g.name: 0.0 for g in plan.groups}
    finish: dict[tuple[int, str], float] = {}
    spans: list[Span] = []
    durations: dict[str, list[float]] = {}
    dag = graph.dag()
    # each generating policy's train node, then the sync of its new weights to its generation layout
    # training states sent to host memory for the rollout come back before training: the sync pays the trip
    # (a policy sampling in place moves nothing: its sync takes no time)
    syncs = {
        n: (
            graph.nodes[n].model,
            0.0
            if graph.nodes[n].model in in_place
            else sync_seconds(plan, costs[graph.nodes[n].model], roles, graph.nodes[n].model)
            + costs[graph.nodes[n].model].offload_seconds(gens[graph.nodes[n].model].offloaded),
        )
        for n in order
        if graph.nodes[n].trains and graph.nodes[n].model in roles.actors
    }
    flops_total = 0.0  # forward and train nodes, over all iterations
    gen_flops = 0.0  # generation, over all launched rollouts
    gen_tokens = 0.0
    lengths_mean = mean_length(workload.response_length)
    seq_len = workload.prompt_length + int(lengths_mean)
    sequences = workload.sequences

    streamed = streamed_nodes(graph) if plan.rollout.streaming else set()

    hw = next(iter(costs.values())).hw
    every_task = hw.task_overhead  # host-side work around each device group's task (dispatch, moving its batch)

    def run(it: int, task: str, groups: tuple[str, ...], deps: list[float], seconds: float) -> float:
        if groups and seconds > 0:  # a task on device groups (a sync that moves nothing is none; the controller's
            seconds += every_task  # own work dispatches nothing)
        start = max([0.0, *deps, *(free[g] for g in groups)])
        end = start + seconds
        if task in streamed and (it, "rollout_start") in finish:
            # streaming: starts on the first finished groups and ends with the last part, which generation's
            # last chunk finished, after generation
            gen_start, gen_end = finish[(it, "rollout_start")], finish[(it, "rollout_end")]
            others = [d for d in deps if d != gen_end]
            start = max([gen_start, *others, *(free[g] for g in groups)])
            end = max(start + seconds, gen_end + seconds * last_part.get(it, 1.0))
        for g in groups:
            free[g] = end
            busy[g] += seconds
        finish[(it, task)] = end
        spans.append(Span(it, task, groups, start, end))
        durations.setdefault(task, []).append(seconds)
        return end

    lengths: dict[int, np.ndarray] = {}  # the response lengths each iteration trains on
    last_part: dict[int, float] = {}  # streaming: the share of each iteration's rows in generation's last part

    filters = graph.filters()
    producers = graph.producers()

    def generation(it: int) -> None:
        nonlocal gen_flops, gen_tokens
        for name in order:
            node = graph.nodes[name]
            if not node.samples:
                continue
            count = sequences if not node.greedy else max(sequences // max(workload.samples_per_prompt, 1), 1)
            group = 1 if node.greedy else workload.samples_per_prompt
            if node_rows and name in node_rows:  # its own rows: another policy's prompts or samples
                asked = node_rows.get(producers.get(node.reads[0], [""])[0], workload.prompts_per_step)
                count, group = node_rows[name], 1 if node.greedy else max(node_rows[name] // max(asked, 1), 1)
            gen, spec = gens[node.model], costs[node.model].model
            seconds, tokens, batch = gen.iteration(count, group)
            lengths[it] = batch
            if name in filters:  # dynamic sampling: more rounds until the filter has passed the batch
                keep = graph.nodes[filters[name]]
                groups = getattr(keep, "groups", None) or workload.prompts_per_step
                wanted = groups / workload.prompts_per_step / workload.acceptance_rate  # rounds to pass them
                rounds = min(wanted, getattr(keep, "max_rounds", 1))
                more = 1.0
                while more < rounds:
                    part = min(rounds - more, 1.0)
                    extra_s, extra_tokens, _ = gen.iteration(count, group)
                    seconds, tokens, more = seconds + part * extra_s, tokens + part * extra_tokens, more + 1.0
            gen_tokens += tokens
            gen_flops += count * workload.prompt_length * spec.flops_per_token(
                workload.prompt_length // 2
            ) + tokens * spec.flops_per_token(seq_len)
            need, sync = it - 1 - lead, f"weight_sync:{node.model}"
            deps = [finish[(need, sync)]] if need >= 0 and (need, sync) in finish else []
            end = run(it, name, node_group(plan, graph, name), deps, seconds)
            finish[(it, "rollout_start")], finish[(it, "rollout_end")] = end - seconds, end
            last_part[it] = gen.last_part

    launched = 0
    for it in range(iterations):
        while launched <= it + lead:  # rollouts run ahead of training by the policy's lead
            generation(launched)
            launched += 1
        if it not in lengths:  # nothing generates (a train-only graph): the data's responses, as the workload has them
            lengths[it] = sample_lengths(workload.response_length, sequences, rng)
        for name in order:
            node = graph.nodes[name]
            if node.samples:
                continue
            deps = [finish[(it, p)] for p in dag.predecessors(name)]
            n_rows = node_rows.get(name, sequences) if node_rows else sequences
            if node.trains or isinstance(node, Forward):
                lay = plan.layout(node.model)
                # (a partial step's batch may differ from the workload's sequences the layout was sized for)
                rows, padded = batching.cut(
                    lengths[it], workload.prompt_length, lay.micro_batch, lay.parallel.dp, sequences
                )
                if rows != lay.micro_batch:  # a token budget's micro-batches
                    lay = msgspec.structs.replace(lay, micro_batch=rows)
            sharded = node.model in roles.trainable if node.model is not None else False
            if node.name in fused:  # its train node's forward computes it
                seconds = 0.0
            elif isinstance(node, Forward):
                c = costs[node.model]
                seconds = c.forward(lay, n_rows, padded, backward=False, sharded=sharded)
                flops_total += n_rows * seq_len * c.model.flops_per_token(seq_len // 2)
            elif node.trains:
                c, layout = costs[node.model], lay
                epochs, minis = (train_steps or {}).get(name, (workload.ppo_epochs, workload.mini_batches))
                seconds = epochs * c.forward(
                    layout, n_rows, padded, backward=True, sharded=sharded, mini_batches=minis
                ) + epochs * minis * c.optimizer_step(layout)
                flops_total += 3 * epochs * n_rows * seq_len * c.model.flops_per_token(seq_len // 2)
            else:
                seconds = hw.controller_row_overhead * n_rows
            run(it, name, node_group(plan, graph, name), deps, seconds)
        for train, (model, sync_s) in syncs.items():
            groups = tuple(dict.fromkeys([plan.layout(model).group, plan.generation_of(model).group]))
            task = "weight_sync" if model == roles.actor else f"weight_sync:{model}"
            run(it, task, groups, [finish[(it, train)]], sync_s)
            finish[(it, f"weight_sync:{model}")] = finish[(it, task)]
    # an iteration ends when its last training-side task does (rollouts of later steps may run on)
    sampling = {name for name, node in graph.nodes.items() if node.samples}
    ends = [max(s.end for s in spans if s.iteration == it and s.task not in sampling) for it in range(iterations)]
    iteration_s = (ends[-1] - ends[warm - 1]) / (iterations - warm)
    window = (ends[warm - 1], ends[-1])
    length = max(window[1] - window[0], 1e-12)
    utilization = {}
    for g in plan.groups:
        inside = sum(max(0.0, min(s.end, window[1]) - max(s.start, window[0])) for s in spans if g.name in s.groups)
        utilization[g.name] = round(min(inside / length, 1.0), 4)
    breakdown = {k: float(np.mean(v[warm:] or v)) for k, v in durations.items() if k not in fused}
    return SimResult(
        iteration_s=iteration_s,
        breakdown=breakdown,
        utilization=utilization,
        spans=spans,
        flops=flops_total / iterations + gen_flops / launched,
        gen_steps=gen_tokens / launched,
        longest_decode=max((g.longest for g in gens.values()), default=0),
    )


# ------------------------------------------------------------------ pictures


def timeline_json(result: SimResult) -> list[dict]:
    return [
        {
            "iteration": s.iteration,
            "task": s.task,
            "groups": list(s.groups),
            "start": round(s.start, 6),
            "end": round(s.end, 6),
        }
        for s in result.spans
    ]


def draw_timeline(result: SimResult, plan: ClusterPlan, path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [g.name for g in plan.groups] + ["controller"]
    tasks = sorted({s.task for s in result.spans})
    cmap = plt.get_cmap("tab20")
    colors = {t: cmap(i % 20) for i, t in enumerate(tasks)}
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(rows) + 1.6))
    for s in result.spans:
        for g in s.groups or ("controller",):
            y = rows.index(g)
            ax.barh(y, s.end - s.start, left=s.start, color=colors[s.task], edgecolor="white", linewidth=0.4)
            if s.end - s.start > 0.04 * (result.spans[-1].end or 1):
                ax.text(
                    s.start + (s.end - s.start) / 2,
                    y,
                    f"{s.task}\n#{s.iteration}",
                    ha="center",
                    va="center",
                    fontsize=6,
                )
    ax.set_yticks(range(len(rows)), [f"{r} ({plan.group(r).devices} dev)" if r != "controller" else r for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"predicted timeline: {result.iteration_s:.2f} s/iteration", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[t]) for t in tasks]
    ax.legend(handles, tasks, fontsize=6, ncol=min(6, len(tasks)), loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
